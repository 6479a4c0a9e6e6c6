"""What a bench plot draws, read from the figure itself: the figures a call saved, each labelled series' points and
error bars. A file's size passes an empty figure (one stood in the docs for hours); these do not."""

from __future__ import annotations


def saved_figures(monkeypatch) -> list:
    """Every matplotlib Figure saved from now on, in order (saving still writes the file)."""
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig

    def savefig(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return figures


def series(ax) -> dict[str, list[tuple[float, float]]]:
    """Each labelled line's and error bar's (x, y) points on `ax`, by label."""
    from matplotlib.container import ErrorbarContainer

    out = {}
    for line in ax.get_lines():
        if not line.get_label().startswith("_"):
            out[line.get_label()] = [(float(x), float(y)) for x, y in line.get_xydata()]
    for container in ax.containers:
        if isinstance(container, ErrorbarContainer):
            data_line = container.lines[0]
            out[container.get_label()] = [(float(x), float(y)) for x, y in data_line.get_xydata()]
    return out


def error_bars(ax) -> dict[str, list[tuple[float, float]]]:
    """Each error bar series' (low, high) y ends, by label."""
    from matplotlib.container import ErrorbarContainer

    out = {}
    for container in ax.containers:
        if isinstance(container, ErrorbarContainer) and container.lines[2]:
            segments = container.lines[2][0].get_segments()
            out[container.get_label()] = [(float(s[0][1]), float(s[1][1])) for s in segments]
    return out
