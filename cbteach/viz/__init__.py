"""Pictures of continuous batching, drawn from what the engine really did.

* :mod:`~cbteach.viz.mask` -- the attention mask of a packed step, as text or a heatmap
  (also ``python -m cbteach mask --cached 3,0,5 --new 1,4,1``);
* :mod:`~cbteach.viz.timeline` -- slot timelines of static and continuous runs, and the share of
  slot-steps each wastes;
* :mod:`~cbteach.viz.stepper` -- one engine step at a time: packed row, mask, slots; and
  ``mask_explorer()``, a widget that redraws a mask from typed lengths;
* :mod:`~cbteach.viz.pool` -- the paged KV cache's block pool and block tables;
* :mod:`~cbteach.viz.overlap` -- each step's CPU work and forward pass, serial or overlapped (async
  scheduling).

Everything reads :class:`~cbteach.StepRecord` / :class:`~cbteach.StaticResult` objects, and the
masks come from :mod:`cbteach.attention.packing` itself, so a picture cannot drift from the engine.
matplotlib comes with cbteach; the sliders need ipywidgets (``pip install 'cbteach[colab]'`` or ``[lab]``).
"""
from .mask import mask_ascii, mask_heatmap
from .mask_cli import cli
from .overlap import overlap_stats, plot_overlap
from .pool import draw_memory_map, draw_pool, draw_pool_step, memory_map, pool_slider, stored_tokens
from .stepper import draw_step, mask_explorer, step_through
from .style import request_colors, seq_letter
from .timeline import (plot_timeline, plot_timelines, slot_states_continuous, slot_states_static, waste_breakdown,
                       wasted_fraction)

__all__ = ["mask_ascii", "mask_heatmap", "cli", "slot_states_static", "slot_states_continuous", "wasted_fraction",
           "waste_breakdown", "plot_timeline", "plot_timelines", "draw_step", "mask_explorer", "step_through", "draw_pool",
           "draw_pool_step", "draw_memory_map", "memory_map", "pool_slider", "stored_tokens", "request_colors", "seq_letter",
           "overlap_stats", "plot_overlap"]
