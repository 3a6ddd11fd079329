"""A third-party denoiser plugin used by name: install its distribution, then ``post_hooks=["softshrink"]``.

What it shows:
* a plugin is an ordinary distribution with one entry point in the group ``opacus_spectral``
  (``examples/denoiser_plugin/``: ``pyproject.toml`` plus one module); once it is installed,
  ``opacus_spectral.available_denoisers()`` lists its denoisers with the distribution that provides them, and
  ``make_private(..., post_hooks=[("softshrink", {"threshold": 1.0})])`` builds one by name with its keywords;
* the denoiser's per-step numbers (``Denoiser.stats``) in the engine's diagnostics.

Run (from a clone, after the README's install line):
    pip install -c constraints.txt ./opacus_spectral ./examples/denoiser_plugin   # once: registers "softshrink"
    python examples/use_denoiser_plugin.py              # real size: 20,000 examples, B = 512, 3 epochs
    python examples/use_denoiser_plugin.py --tiny       # a few seconds (what the tests run)
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from opacus_spectral import PrivacyEngine, available_denoisers

PLUGIN = "softshrink"


def plugin_distribution() -> str:
    """The distribution that registered ``PLUGIN``, or exit with the command that installs it."""
    info = available_denoisers().get(PLUGIN)
    if info is None:
        install = "pip install -c constraints.txt ./opacus_spectral ./examples/denoiser_plugin"
        sys.exit(f"no denoiser named {PLUGIN!r} is installed: run `{install}` first (from the repository's root)")
    return info.distribution or "registered at runtime"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a few seconds at toy size (what the tests run)")
    p.add_argument("--threshold", type=float, default=1.0, help="softshrink's threshold, in units of the noise std")
    args = p.parse_args(argv)
    n, batch, epochs = (256, 32, 1) if args.tiny else (20_000, 512, 3)
    print(f"{PLUGIN!r} comes from the distribution {plugin_distribution()!r}")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :3].sum(dim=1) > 0).long()  # replace with your data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))  # replace with your model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    engine = PrivacyEngine(accountant="prv")
    model, optimizer, loader = engine.make_private(
        module=model,
        optimizer=optimizer,
        data_loader=DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        post_hooks=[(PLUGIN, {"threshold": args.threshold})],  # by name, with the denoiser's keywords
    )
    zeroed = entries = 0
    for _ in range(epochs):
        for xb, yb in loader:
            if len(yb) == 0:  # Poisson sampling can draw an empty batch
                continue
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            stats = engine.post_hooks.diagnostics.last.denoisers[PLUGIN]
            zeroed, entries = zeroed + int(stats["zeroed"]), entries + stats["entries"]
    accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    print(f"steps: {engine.post_hooks.logical_steps}, ε = {engine.get_epsilon(1e-5):.2f} at δ = 1e-5")
    print(f"{PLUGIN} set {zeroed / entries:.1%} of the gradient entries to zero; training accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main()
