"""The profile picture (PNG, matplotlib Agg): activation-frequency curves, sparsity, expert heat map.

Example::

    png = render_profile_png(profile)          # bytes
    Path("profile.png").write_bytes(png)
"""
from __future__ import annotations

import io

import torch

PLOT_FILE = "profile.png"


def render_profile_png(profile) -> bytes:
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib import cm

    freq = profile.neuron_freq.double()  # [L, F]
    n_layers = freq.shape[0]
    dense = [i for i in range(n_layers) if float(freq[i].sum()) > 0]
    panels = 3 if profile.is_moe else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.0 * panels, 4.6), dpi=110)
    title = f"{profile.model_id}: {profile.activity} activity"
    if profile.quality.get("max_quality_loss") is not None and profile.activity == "threshold":
        title += (f", budget {profile.quality['max_quality_loss']:.1%} -> "
                  f"{profile.quality.get('perplexity_increase', 0):+.2%} perplexity")
    fig.suptitle(title)

    ax = axes[0]
    colors = cm.viridis(torch.linspace(0, 1, max(n_layers, 2)).numpy())
    for i in dense:
        f = torch.sort(freq[i], descending=True).values.clamp(min=1e-6)
        ax.plot(torch.arange(1, f.numel() + 1).numpy(), f.numpy(), color=colors[i], lw=0.9)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("neuron rank (hottest first)")
    ax.set_ylabel("activation frequency")
    ax.set_title("sorted activation frequency per layer")
    if dense:
        sm = cm.ScalarMappable(cmap="viridis", norm=plt.Normalize(0, n_layers - 1))
        fig.colorbar(sm, ax=ax, label="layer")

    ax = axes[1]
    layers = torch.arange(n_layers).numpy()
    ax.bar(layers, profile.tensors["layer_sparsity"].numpy(), color="tab:blue", label="calibration (train)")
    if "held_out_sparsity" in profile.tensors:
        ax.plot(layers, profile.tensors["held_out_sparsity"].numpy(), "o", color="tab:orange", ms=3.5, label="held out")
    if "neuron_skew" in profile.tensors:
        ax.plot(layers, profile.tensors["neuron_skew"].numpy(), "-", color="tab:green", lw=1.2,
                label="neurons carrying 80% of activations")
    ax.set_ylim(0, 1.18)
    ax.set_xlabel("layer")
    ax.set_ylabel("fraction")
    ax.set_title("per-layer sparsity and skew")
    ax.legend(fontsize=7, loc="upper center", ncol=3, frameon=False)

    if profile.is_moe:
        ax = axes[2]
        ef = profile.tensors["expert_freq"].numpy()  # [L, E]
        im = ax.imshow(ef, aspect="auto", cmap="magma", interpolation="nearest")
        ax.set_xlabel("expert")
        ax.set_ylabel("layer")
        ax.set_title("expert selection frequency")
        fig.colorbar(im, ax=ax, label="share of tokens")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()
