"""bf16 convolution weight gradient of a 3x3 stride-2 pad-1 conv on a 1x1 input, against fp32, on CUDA."""
import torch, torch.nn.functional as F
def case(dt, dev):
    torch.manual_seed(0)
    x = torch.randn(8, 64, 1, 1).to(dev, dt); w = torch.randn(64, 64, 3, 3).to(dev, dt).requires_grad_(True)
    out = F.conv2d(x, w, stride=2, padding=1); out.backward(torch.randn(out.shape).to(dev, dt))
    return w.grad.float().cpu()
for dev in ["cuda"]:
    ref = case(torch.float32, dev)
    for trial in range(5):
        b = case(torch.bfloat16, dev); off = b.clone(); off[..., 1, 1] = 0
        print(f"{dev} bf16 trial {trial}: centre rel err {float((b[...,1,1]-ref[...,1,1]).norm()/ref[...,1,1].norm()):.3g}, off-centre max {float(off.abs().max()):.3g}", flush=True)
