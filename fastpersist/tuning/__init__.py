"""``fastpersist tune``: measure which settings save and load fastest on a filesystem, write them as a configuration.

The product's tuner (:mod:`.tuner`: the sweep and its report), the
model-shaped synthetic checkpoints it measures with (:mod:`.workloads`), and
the measuring tools it shares with the benchmarks (:mod:`.measure`). The
benchmarks (:mod:`fastpersist.bench`) build on these; nothing here imports
them. See docs/tuning.md.
"""
