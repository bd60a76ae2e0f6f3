"""The reduced ncalib sweep actually run for issue 12 (the full matrix took ~150 s/cell on the loaded 2-core box).

Runs `rcpu-bench run --matrix ncalib` in-process with fewer N_calib, λ values and perplexity stories, and with the
record's inference-speed and text-sample measurements replaced by an explicit "skipped" entry (they took
~60 % of each cell at load average 20 and are not part of the sweep). Every other field is what the runner
records; cell ids are those of the overridden matrix. Run from the repository root:

    python results/ncalib/run_reduced.py

What the store holds (the machine ran at load average 20-25, ~1-17 min per cell): this script's cells for
N_calib 2, 8, 32 (all six methods) and 128 (ridge λ = 1e-2, 1, 1e2; stopped at the deadline), plus two
N_calib = 512 cells run the same way in separate processes with ``--set calib.n_calib=[512]`` (ridge λ = 1e-2)
and additionally ``--set methods=[rcpu-rot]`` (RCPU (Rot.)), their store lines appended to this store.
``summary.txt`` lists every cell; ``generalisation.md``, ``tables.md`` and ``plots/`` are rendered from it.
"""

import sys

from rcpu_bench import cli
from rcpu_bench.matrix import experiment

SKIPPED = {"skipped": "not measured in the reduced ncalib sweep (results/ncalib/run_reduced.py)"}
experiment.inference_speed = lambda model: SKIPPED
experiment.text_sample = lambda model, tokenizer: SKIPPED

sys.exit(cli.main(["run", "--matrix", "ncalib", "--quiet",
                   "--set", "calib.n_calib=[2, 8, 32, 128, 512]",
                   "--set", "lambdas=[1.0e-2, 1.0, 1.0e+2, 1.0e+4]",
                   "--set", "ppl_profiles=['tinystories[500:530]']"]))
