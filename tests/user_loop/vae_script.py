# pytorch/examples vae/main.py's shape (its VAE, loss_function, train(), Adam), torchvision's MNIST swapped for random
# tensors of its shape, replaybisect's three lines added (marked), and a fault keyed on the data planted: the loss
# divides each image's reconstruction error by the image's total brightness, and image --blank of the data set is all
# zeros, so x / 0 = inf in that image's row only. Run: python vae_script.py --blank 70 --epochs 1
import argparse
import torch
import torch.utils.data
from torch import nn
from torch.nn import functional as F
import replaybisect                                                    # 1

PLANT = "loss"


class VAE(nn.Module):
    def __init__(self):
        super(VAE, self).__init__()
        self.fc1 = nn.Linear(784, 400)
        self.fc21 = nn.Linear(400, 20)
        self.fc22 = nn.Linear(400, 20)
        self.fc3 = nn.Linear(20, 400)
        self.fc4 = nn.Linear(400, 784)

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        std = torch.exp(0.5 * logvar)
        eps = torch.randn_like(std)
        return mu + eps * std

    def decode(self, z):
        h3 = F.relu(self.fc3(z))
        return torch.sigmoid(self.fc4(h3))

    def forward(self, x):
        x = x.view(-1, 784)
        if PLANT == "forward":
            x = x / x.amax(dim=1, keepdim=True)  # the bug: 0 / 0 for a blank image
        mu, logvar = self.encode(x)
        z = self.reparameterize(mu, logvar)
        return self.decode(z), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    x = x.view(-1, 784)
    BCE = F.binary_cross_entropy(recon_x, x, reduction='none').sum(1)
    if PLANT == "loss":
        BCE = BCE / x.sum(1)  # the bug: each image's error relative to its brightness (x / 0 for a blank one)
    BCE = BCE.sum()
    KLD = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return BCE + KLD


def train(args, model, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, _) in enumerate(train_loader):
        optimizer.zero_grad()
        recon_batch, mu, logvar = model(data)
        loss = loss_function(recon_batch, data, mu, logvar)
        loss.backward()
        optimizer.step()
        print('Train Epoch: {} [{}/{}]\tLoss: {:.6f}'.format(
            epoch, batch_idx * len(data), len(train_loader.dataset), loss.item() / len(data)))


def main():
    parser = argparse.ArgumentParser(description='VAE MNIST Example')
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--epochs', type=int, default=1)
    parser.add_argument('--seed', type=int, default=1)
    parser.add_argument('--blank', type=int, default=-1, help='the data set index of an all-zero image (-1: none)')
    parser.add_argument('--plant', choices=['loss', 'forward'], default='loss')
    args = parser.parse_args()
    global PLANT
    PLANT = args.plant
    torch.manual_seed(args.seed)
    images = torch.rand(160, 1, 28, 28) * 0.9 + 0.05
    if args.blank >= 0:
        images[args.blank] = 0.0
    dataset = torch.utils.data.TensorDataset(images, torch.zeros(160, dtype=torch.long))
    train_loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    model = VAE()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = replaybisect.Recorder(model, optimizer, config=vars(args), snapshot_every=2)  # 2
    for epoch in range(1, args.epochs + 1):
        train(args, model, train_loader, optimizer, epoch)
    rec.close()                                                        # 3


if __name__ == '__main__':
    main()
