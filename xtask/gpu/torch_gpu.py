# A PyTorch CUDA workload for memtrace's GPU domain: tensors of mixed sizes, a matmul
# (cuBLAS workspace), frees, empty_cache; then prints torch.cuda.memory_stats() figures.
import json, os, sys, torch
torch.cuda.init()
x = torch.empty(1, device="cuda")
keep = []
for i in range(40):
    n = (1 << 20) * (1 + i % 7)  # 1..7 M floats
    t = torch.randn(n, device="cuda")
    if i % 3 == 0:
        keep.append(t)
big = torch.randn(8192, 8192, device="cuda")
y = big @ big
del big
small = [torch.ones(1000 + i, device="cuda") for i in range(200)]
del small
torch.cuda.synchronize()
torch.cuda.empty_cache()
z = torch.randn(64 << 20, device="cuda")  # 256 MiB
torch.cuda.synchronize()
s = torch.cuda.memory_stats()
keys = ["segment.all.allocated", "segment.all.freed", "segment.all.current",
        "reserved_bytes.all.allocated", "reserved_bytes.all.freed", "reserved_bytes.all.current",
        "reserved_bytes.all.peak", "num_alloc_retries", "num_ooms"]
out = {k: s.get(k) for k in keys}
out["torch"] = torch.__version__
out["cuda"] = torch.version.cuda
out["conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
print("TORCH_STATS " + json.dumps(out))
