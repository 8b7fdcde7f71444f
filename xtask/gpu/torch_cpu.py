# A PyTorch CPU workload for many-CPU machines (issue #12): an MLP and a small conv net
# trained for a few seconds on every core (intra-op threads allocate on all CPUs at
# once), tensors of mixed sizes, a DataLoader; prints what it did and torch's thread count.
import os, sys, time, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(7)
threads = int(os.environ.get("TORCH_THREADS", os.cpu_count() or 1))
torch.set_num_threads(threads)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 60
mlp = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
conv = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                     nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                     nn.Flatten(), nn.Linear(64 * 16, 10))
data = TensorDataset(torch.randn(steps * 64, 512), torch.randint(0, 10, (steps * 64,)))
opt = torch.optim.SGD(list(mlp.parameters()) + list(conv.parameters()), lr=0.01)
loss_fn = nn.CrossEntropyLoss()
started = time.time()
for i, (x, y) in enumerate(DataLoader(data, batch_size=64, shuffle=True)):
    opt.zero_grad()
    img = torch.randn(32, 3, 32 + (i % 4) * 8, 32 + (i % 4) * 8)
    loss = loss_fn(mlp(x), y) + loss_fn(conv(img), y[:32])
    loss.backward()
    opt.step()
    parts = [torch.empty(1 << (i % 20)) for _ in range(8)]  # 4 B .. 2 MiB, freed at once
    del parts
print(f"TORCH_CPU steps={steps} threads={torch.get_num_threads()} loss={loss.item():.3f} "
      f"train_s={time.time() - started:.2f}")
