"""pytorch/examples time_sequence_prediction/train.py as written: two LSTMCells in float64 learn sine waves, trained
with LBFGS (a closure that clears the gradients, runs the sequence and backpropagates), a test prediction after each
step. The data is made here (generate_sine_wave.py's, smaller). LBFGS re-evaluates its closure inside step(), so the
recording takes the documented step-function form: the loop body's closure and step moved into `train_step`, the
objects' making into `build` (the lines marked `# replaybisect`).
Run: python time_sequence_script.py [--steps 6]"""
import argparse

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

import replaybisect  # replaybisect


class Sequence(nn.Module):
    def __init__(self):
        super(Sequence, self).__init__()
        self.lstm1 = nn.LSTMCell(1, 16)
        self.lstm2 = nn.LSTMCell(16, 16)
        self.linear = nn.Linear(16, 1)

    def forward(self, input, future=0):
        outputs = []
        h_t = torch.zeros(input.size(0), 16, dtype=torch.double)
        c_t = torch.zeros(input.size(0), 16, dtype=torch.double)
        h_t2 = torch.zeros(input.size(0), 16, dtype=torch.double)
        c_t2 = torch.zeros(input.size(0), 16, dtype=torch.double)

        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        for i in range(future):  # if we should predict the future
            h_t, c_t = self.lstm1(output, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            output = self.linear(h_t2)
            outputs += [output]
        outputs = torch.cat(outputs, dim=1)
        return outputs


def build(config):  # replaybisect
    seq = Sequence()
    seq.double()
    return seq, optim.LBFGS(seq.parameters(), lr=0.8, max_iter=5)


def train_step(model, optimizer, batch):  # replaybisect
    input, target = batch
    criterion = nn.MSELoss()

    def closure():
        optimizer.zero_grad()
        out = model(input)
        loss = criterion(out, target)
        print('loss:', loss.item())
        loss.backward()
        return loss
    return optimizer.step(closure)


if __name__ == '__main__':
    parser = argparse.ArgumentParser()
    parser.add_argument('--steps', type=int, default=6, help='steps to run')
    opt = parser.parse_args()
    np.random.seed(2)
    T, L, N = 20, 60, 24
    x = np.empty((N, L), 'int64')
    x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
    data = np.sin(x / 1.0 / T).astype('float64')
    torch.manual_seed(0)
    input = torch.from_numpy(data[3:, :-1])
    target = torch.from_numpy(data[3:, 1:])
    test_input = torch.from_numpy(data[:3, :-1])
    test_target = torch.from_numpy(data[:3, 1:])
    seq, optimizer = build({})  # replaybisect
    criterion = nn.MSELoss()
    rec = replaybisect.Recorder(seq, optimizer, step_fn=train_step, build=build)  # replaybisect
    for i in range(opt.steps):
        print('STEP: ', i)
        rec.step((input, target))  # replaybisect
        with torch.no_grad():
            future = 20
            pred = seq(test_input, future=future)
            loss = criterion(pred[:, :-future], test_target)
            print('test loss:', loss.item())
    rec.close()  # replaybisect
