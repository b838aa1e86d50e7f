# pytorch/examples dcgan/main.py's shape (its Generator, Discriminator, BCELoss, two Adam optimizers, the update of D on
# real and detached fakes, then of G through D), made small (16x16 single-channel images, random tensors for the data
# set), replaybisect's three lines added (marked), and a realistic bug planted: the discriminator scales each image by
# its own max (0 / 0 for an all-zero image), and BCELoss refuses the NaN it makes, so the step raises.
# Run: python gan_script.py --blank 70
import argparse
import torch
import torch.nn as nn
import torch.optim as optim
import torch.utils.data
import replaybisect                                                    # 1

nz, ngf, ndf, nc = 8, 8, 8, 1


class Generator(nn.Module):
    def __init__(self):
        super(Generator, self).__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False),
            nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.ReLU(True),
            nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False),
            nn.Tanh()
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super(Discriminator, self).__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ndf * 2),
            nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf * 2, 1, 4, 1, 0, bias=False),
            nn.Sigmoid()
        )

    def forward(self, input):
        input = input / input.abs().amax(dim=(1, 2, 3), keepdim=True)  # the bug: each image scaled by its max
        output = self.main(input)
        return output.view(-1, 1).squeeze(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--batchSize', type=int, default=16)
    parser.add_argument('--niter', type=int, default=1)
    parser.add_argument('--lr', type=float, default=0.0002)
    parser.add_argument('--beta1', type=float, default=0.5)
    parser.add_argument('--manualSeed', type=int, default=1)
    parser.add_argument('--blank', type=int, default=-1, help='the data set index of an all-zero image (-1: none)')
    opt = parser.parse_args()
    torch.manual_seed(opt.manualSeed)
    images = torch.rand(320, nc, 16, 16) * 1.8 - 0.9
    if opt.blank >= 0:
        images[opt.blank] = 0.0
    dataset = torch.utils.data.TensorDataset(images, torch.zeros(320, dtype=torch.long))
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=opt.batchSize, shuffle=True)

    netG = Generator()
    netD = Discriminator()
    criterion = nn.BCELoss()
    real_label, fake_label = 1, 0
    optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
    rec = replaybisect.Recorder({"G": netG, "D": netD}, {"G": optimizerG, "D": optimizerD},   # 2
                                config=vars(opt), snapshot_every=4)

    for epoch in range(opt.niter):
        for i, data in enumerate(dataloader, 0):
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            netD.zero_grad()
            real_cpu = data[0]
            batch_size = real_cpu.size(0)
            label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
            output = netD(real_cpu)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()

            noise = torch.randn(batch_size, nz, 1, 1)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            optimizerD.step()

            # (2) Update G network: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = output.mean().item()
            optimizerG.step()
            print('[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f'
                  % (epoch, opt.niter, i, len(dataloader), errD.item(), errG.item(), D_x, D_G_z1, D_G_z2))
    rec.close()                                                        # 3


if __name__ == '__main__':
    main()
