"""``python -m pipeline --help``: the groups a user picks from, their options, and the config they compose.

Hydra's own help lists every group on its search path, so it offered the
schemas' ``base_*`` nodes and the automatic ``specialize`` presets as if they
were choices. This lists the option files of ``conf/`` instead (one line
each, with the option's first comment), names the preset rule in a
sentence, and prints the config the given overrides compose. Hydra's help
stays at ``--hydra-help``.
"""

from __future__ import annotations

from pipeline.plan.options import groups, option_summary

def help_text(overrides: list[str]) -> str:
    from omegaconf import OmegaConf

    from pipeline.plan.inputs import compose

    cfg = compose(overrides, with_hydra=True)
    chosen = dict(cfg.hydra.runtime.choices)
    lines = ["python -m pipeline [group=option ...] [key=value ...]   (-m: a sweep over comma-separated values)",
             "", "== Groups (group=option; * the one these overrides compose) =="]
    for group, options in groups().items():
        lines.append(f"{group}:")
        for path in options:
            mark = "*" if chosen.get(group) == path.stem else " "
            summary = option_summary(path)
            lines.append(f"  {mark} {path.stem:<22}{summary}")
    lines += ["", "Presets: conf/specialize/<trainer>_<env>.yaml apply on their own when the pair matches "
              "(the plan names the one a run got).",
              "Every key: docs/config.md. Hydra's own help: --hydra-help.",
              "", "== Config ==", OmegaConf.to_yaml({k: v for k, v in cfg.items() if k != "hydra"}, resolve=False)]
    return "\n".join(lines)
