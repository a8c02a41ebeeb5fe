"""``horizonrl view RUN_DIR``: a local web page for a run's recorded episodes (docs/episodes.md).

- ``index``: the episodes and "trained" lines of ``<run_dir>/episodes/``, followed as they grow, and
  the filters of the list page;
- ``replay``: what the records do not hold, rebuilt by playing the recorded replies again in a fresh
  environment (BabyAI's grid as PNG frames, TextCraft's inventory);
- ``pages`` and ``assets``: the HTML, the style sheet and the small script (no build step, no CDN);
- ``server``: the aiohttp routes and the command's main loop.
"""
