"""The seven zero-shot tasks and which metric (acc or acc_norm) each paper's tables report for them.

Kept apart from ``zeroshot`` (which drives lm-eval) so that the tables can use it without loading lm-eval.
"""

from __future__ import annotations

TASKS = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")

METRIC_MAPS: dict[str, dict[str, str]] = {
    "paper": {"boolq": "acc", "piqa": "acc", "hellaswag": "acc_norm", "winogrande": "acc",
              "arc_easy": "acc_norm", "arc_challenge": "acc_norm", "openbookqa": "acc_norm"},
    "slicegpt": {"boolq": "acc", "piqa": "acc_norm", "hellaswag": "acc_norm", "winogrande": "acc",
                 "arc_easy": "acc_norm", "arc_challenge": "acc_norm", "openbookqa": "acc"},
}


def table_metric(task: str, metric_map: str = "paper") -> str:
    """The metric that a results table shows for ``task`` under ``metric_map`` (``METRIC_MAPS``).

    ``slicegpt``: SliceGPT's ``run_lm_eval.py`` reports acc_norm for piqa, hellaswag, arc_easy and
    arc_challenge and acc for winogrande; boolq and openbookqa are not in its task list and take acc.

    ``paper`` (the RCPU paper's tables tab:benchmark / tab:benchmark2, made with lm-eval), read off the
    dense rows:

    - BoolQ and WinoGrande: acc, the only metric lm-eval has for them.
    - HellaSwag, ARC-e, ARC-c, OBQA: acc_norm. Dense Llama-7B scores 76.18 / 72.85 / 44.79 / 44.40;
      lm-eval's acc for that model is about 57 / 75 / 42 / 34 (e.g. Wanda's tables): only acc_norm
      reaches 76 on HellaSwag and 44 on OBQA, and only acc_norm lies below acc on ARC-e.
    - PIQA: acc, not acc_norm. The dense Llama-2-13B row matches SliceGPT's paper, which reports
      acc_norm, within 0.2 points on HellaSwag (79.37 vs 79.39), ARC-e (77.44 vs 77.48), ARC-c (49.06
      vs 49.23) and WinoGrande (72.14 vs 72.22, acc), but its PIQA is 79.05 against SliceGPT's acc_norm
      80.47; acc is the only other PIQA metric.

    The Wanda and SliceGPT figures are recalled from those papers; the paper's own numbers are in
    ``shared/reference/rcpu_paper_tables.csv``.
    """
    return METRIC_MAPS[metric_map][task]
