"""Tables of bench/results/deepspeed_findings.md: DeepSpeed's known problems, checked by running it.

Rendered from the ``findings`` section of a results JSON (``{"runs": [...], "pairs": [...]}``, written
by ``python -m bench --sections deepspeed,findings``); every row carries its command. What each check
means and why DeepSpeed behaves so: docs/readme/performance.md, "DeepSpeed findings".
"""

from __future__ import annotations

from bench.md import data, produced_by, table


def _grad_row(label: str, res: dict, ref: dict, cmd: str) -> list:
    per_rank = ", ".join(f"{g:.4f}" for g in res["grad_norm_step1_per_rank"])
    return [label, per_rank, f"{ref['grad_norm_step1']:.4f}", f"{res['grad_norm_step1'] / ref['grad_norm_step1']:.3f}",
            f"{res['param_spread_in_sp_group']:.2e}", f"`{cmd}`"]  # fmt: skip


GRAD_HEADER = ["run", "step-1 grad norm per rank", "oracle", "ratio", "param spread in SP group", "command"]


def render_findings(result: dict) -> str:
    found = data(result, "findings")
    runs = {r["name"]: r for r in found["runs"]}
    pairs = [p for p in found.get("pairs", []) if "error" not in p]
    ver = next((p["deepspeed"].get("deepspeed_version") for p in pairs), None) or next(
        (r["result"]["deepspeed_version"] for r in found["runs"] if r["result"]), "?"
    )
    out = ["# DeepSpeed Ulysses/ALST on CPU: what we measured", "",
           f"DeepSpeed {ver} (`bench/.venv-deepspeed`). {produced_by(result, 'findings')}", "",
           "## 1. Step-1 gradient norm against the single-process oracle", ""]  # fmt: skip
    rows = []
    if (z0 := runs.get("zero0")) and z0["result"]:
        rows.append(_grad_row("dp1 x sp2, ZeRO 0", z0["result"], z0["reference"], z0["command"]))
    for side, cmd, prefix in (
        ("deepspeed", "deepspeed_command", ""),
        ("ours", "ours_command", "ulysses-sp "),
    ):
        for p in pairs:
            pt = p["point"]
            label = f"{prefix}dp{pt['dp']} x sp{pt['sp']}, ZeRO {pt['zero']}"
            rows.append(_grad_row(label, p[side], p["reference"], p[cmd]))
    out += [table(GRAD_HEADER, rows), ""]
    if (sgd := runs.get("sgd")) and sgd["result"]:
        r, ref = sgd["result"]["losses"], sgd["reference"]["losses"]
        out += ["## 1b. Plain SGD (not scale invariant), same lr on both sides", "", table(
            ["run", "losses DeepSpeed", "losses oracle", "max |diff|", "command"],
            [["dp1 x sp2, ZeRO 1, SGD lr 0.1", ", ".join(f"{x:.5f}" for x in r), ", ".join(f"{x:.5f}" for x in ref),
              f"{max(abs(a - b) for a, b in zip(r, ref)):.2e}", f"`{sgd['command']}`"]]), ""]  # fmt: skip
    if (adam := runs.get("adam_lr1e-2")) and adam["result"]:
        r, ref = adam["result"]["losses"], adam["reference"]
        out += ["## 1c. Adam at lr 1e-2: DeepSpeed against the oracle with gradients x1 and x2", "", table(
            ["run", "steps", "final loss DeepSpeed", "oracle", "oracle, gradient x2", "|diff| vs oracle",
             "|diff| vs oracle x2", "command"],
            [["dp1 x sp2, ZeRO 1, S=256", len(r), f"{r[-1]:.5f}", f"{ref['losses'][-1]:.5f}",
              f"{ref['losses_grad_x2'][-1]:.5f}", f"{abs(r[-1] - ref['losses'][-1]):.1e}",
              f"{abs(r[-1] - ref['losses_grad_x2'][-1]):.1e}", f"`{adam['command']}`"]]), ""]  # fmt: skip
    if mesh := runs.get("mesh_param"):
        out += ["## 2. `deepspeed.initialize(mesh_param=(1, 2))`: gradients across the SP group", ""]
        if mesh["result"]:
            row = _grad_row(
                "dp1 x sp2, ZeRO 1, mesh_param", mesh["result"], mesh["reference"], mesh["command"]
            )
            out += [table([*GRAD_HEADER[:3], "ratio (rank 0)", *GRAD_HEADER[4:]], [row]), ""]
        else:
            out += [
                table(
                    ["run", "error", "command"],
                    [["mesh_param", mesh["error"][0][:300], f"`{mesh['command']}`"]],
                ),
                "",
            ]
    checks = []
    for name, what in (("micro_batch_2", "micro-batch 2"), ("dp2_all_gather_recipe", "dp2 x sp2, all_gather loss recipe"),
                       ("unequal_lengths", "unequal lengths across an SP group (64 and 32 tokens)")):  # fmt: skip
        if (r := runs.get(name)) is None:
            continue
        if r["error"]:
            checks.append([what, "fails", "; ".join(e[:300] for e in r["error"][:3]), f"`{r['command']}`"])
        elif r["reference"]:
            res, ref = r["result"], r["reference"]
            detail = (f"step-1 loss {res['losses'][0]:.6f} vs oracle {ref['losses'][0]:.6f}; grad "
                      f"{res['grad_norm_step1'] / ref['grad_norm_step1']:.3f}x the oracle's")  # fmt: skip
            checks.append([what, "completes", detail, f"`{r['command']}`"])
        else:
            checks.append([what, "completes", "", f"`{r['command']}`"])
    if checks:
        out += [
            "## 3. Failures on CPU (micro-batch > 1, dp > 1, unequal lengths)",
            "",
            table(["check", "outcome", "detail", "command"], checks),
            "",
        ]
    return "\n".join(out)
