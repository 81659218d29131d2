"""The sweep summary: every point of the grid with its state and reason, the heatmap's layout, the sweeps page."""
from __future__ import annotations

import pytest

from wanexp.callbacks.sweep import TRAIN_LOSS, VAL_LOSS


@pytest.mark.parametrize("ranks,lrs", [(["4"], ["0.0001"]), (["4", "8"], ["0.0001", "0.001"]),
                                       (["8", "16", "32", "64"], ["5e-05", "0.0001", "0.0002"])])
@pytest.mark.parametrize("metric", [TRAIN_LOSS, VAL_LOSS])
def test_the_heatmap_shows_its_colour_bar_label_whole(ranks, lrs, metric):
    """Every text of the heatmap (the colour bar's label naming the loss and "lower is better", the title, the
    ticks and the cells) lies inside the saved figure, for a one-cell grid too."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from wanexp.callbacks.sweep import heatmap_figure

    z = np.arange(len(ranks) * len(lrs), dtype=float).reshape(len(ranks), len(lrs)) + 0.123
    fig = heatmap_figure(z, ranks, lrs, "adapter.rank", "optim.lr", "rank_lr", metric)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bar = fig.axes[1].yaxis.label
    assert " ".join(bar.get_text().split()) == f"{metric}, lower is better"
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    outside = [t.get_text() for t in texts if not fig.bbox.contains(*t.get_window_extent(renderer).min)
               or not fig.bbox.contains(*t.get_window_extent(renderer).max)]
    plt.close(fig)
    assert not outside, outside
