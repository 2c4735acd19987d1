"""``ulysses-sp plan`` as a new user meets it: host states on one GPU, host states considered by
itself when nothing fits on the devices, ``--mfu`` refused outside ``(0, 1]``, and recommendations
that ``train`` accepts (``--seq-len`` capped at the model's positions)."""

from __future__ import annotations

import json

import pytest

from ulysses_sp.cli.args import build_parser, train_options
from ulysses_sp.cli.main import main


def _plan(capsys, *argv: str) -> dict:
    main(["plan", *argv, "--json"])
    return json.loads(capsys.readouterr().out)


def _host_rows(doc: dict) -> list[dict]:
    return [c for c in doc["candidates"] if c["settings"].get("cpu_offload")]


def test_offload_states_on_one_gpu_considers_zero3_with_states_on_the_host(capsys):
    """The CLI guide's "757K tokens on 1 GPU" (428K without norm recompute; the flash backward's workspace
    counted), and 1.10M with 8 head groups at sp 1 (the workspace per group): this exact command, its
    full-technique host-state rows."""
    argv = ("--model", "llama-8b", "--gpus", "1", "--dtype", "bf16", "--offload-states", "--max")
    doc = _plan(capsys, *argv)
    host = _host_rows(doc)
    assert host and all(c["settings"]["zero_stage"] == 3 and c["settings"]["nproc"] == 1 for c in host)
    full = {(c["settings"].get("recompute_norms", False), c["settings"].get("head_chunks", 1)): c
            for c in host if c["settings"].get("offload_activations")}  # fmt: skip
    assert full[False, 1]["max_seq_len"] // 1000 == 428 and full[False, 1]["fits"]
    assert full[True, 1]["max_seq_len"] // 1000 == 756 and full[True, 1]["fits"]
    # head groups (the whole attention block per group): the fewest that reach the longest
    assert full[True, 8]["max_seq_len"] // 1000 == 1377 and full[True, 8]["fits"]
    assert full[True, 8]["tokens_per_s"] < full[True, 1]["tokens_per_s"]  # one more attention forward
    best = doc["recommended"]
    assert best["settings"]["cpu_offload"] and best["settings"]["zero_stage"] == 3
    assert doc["offload_states"] == "also"
    main(["plan", *argv])
    table = capsys.readouterr().out
    assert "sp 1 zero 3 loss+mlp+ckpt+offload+states->host" in table and "428,482" in table
    assert "sp 1 zero 3 loss+mlp+ckpt+offload+norms+states->host" in table and "756,642" in table
    assert "sp 1 zero 3 loss+mlp+ckpt+offload+norms+states->host+heads8" in table and "1,377,235" in table
    assert "nothing fits" not in table


def test_when_nothing_fits_on_the_devices_plan_considers_host_states_and_says_so(capsys):
    doc = _plan(capsys, "--model", "llama-8b", "--gpus", "1", "--dtype", "bf16")
    assert doc["offload_states"] == "auto"
    assert not any(c["fits"] for c in doc["candidates"] if not c["settings"].get("cpu_offload"))
    assert doc["recommended"]["settings"]["cpu_offload"]
    assert any("nothing fits on the devices alone" in n for n in doc["notes"])
    main(["plan", "--model", "llama-8b", "--gpus", "1", "--dtype", "bf16"])
    assert "note: nothing fits on the devices alone: model states on the host considered too" in (
        capsys.readouterr().out
    )
    # not even then: said without suggesting the flag that was already tried
    main(["plan", "--model", "tiny-llama", "--device", "cpu", "--memory", "1KB", "--seq-len", "64"])
    out = capsys.readouterr().out
    assert "nothing fits, even with model states on the host" in out and "or --offload-states" not in out
    # fits on the devices: no host rows unless asked for
    doc = _plan(capsys, "--model", "tiny-llama", "--device", "cpu", "--memory", "1GB", "--seq-len", "64")
    assert doc["offload_states"] == "no" and not _host_rows(doc)
    assert [n for n in doc["notes"] if not n.startswith("the command sets --lr")] == []


@pytest.mark.parametrize("mfu", ["1.5", "40", "0", "-0.2"])
def test_mfu_must_be_a_fraction_in_0_1(capsys, mfu):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--mfu", mfu])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--mfu" in err and mfu in err


def _train_accepts(args: list[str], output_dir) -> None:
    """``train``'s own validation of a recommended command line (before any process starts)."""
    from ulysses_sp.run.resolve import validate

    assert args[:2] == ["ulysses-sp", "train"]
    cfg, launch = train_options(build_parser().parse_args([*args[1:], "--output-dir", str(output_dir)]))
    validate(cfg, launch["nproc"])


def test_the_recommended_command_passes_train_validation_seq_len_capped(capsys, tmp_path):
    doc = _plan(capsys)  # the defaults: tiny-llama, one H100, --max
    best = doc["recommended"]
    assert doc["max_positions"] == 131072 and best["max_seq_len"] > 131072  # memory would allow more
    assert best["settings"]["seq_len"] == 131072
    assert any("S capped at 131,072" in n and "max_position_embeddings" in n for n in doc["notes"])
    _train_accepts(best["train_args"], tmp_path / "a")
    with pytest.raises(ValueError, match="longer than model 'tiny-llama' covers"):  # what plan avoided
        args = best["train_args"]
        _train_accepts([*args[: args.index("--seq-len") + 1], "131074", *args[args.index("--seq-len") + 2 :]],
                       tmp_path / "b")  # fmt: skip
    for i, c in enumerate(doc["candidates"]):  # not only the recommendation: every row's command
        _train_accepts(c["train_args"], tmp_path / f"default-{i}")
    doc = _plan(
        capsys, "--device", "cpu", "--memory", "1GB", "--gpus", "2", "--seq-len", "4096", "--offload-states"
    )
    assert len(doc["candidates"]) > 40 and _host_rows(doc)
    for i, c in enumerate(doc["candidates"]):
        _train_accepts(c["train_args"], tmp_path / f"cpu-{i}")
    # a --seq-len that train refuses is refused by plan too
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--seq-len", "262144"])
    assert exc.value.code == 2 and "--seq-len 262144 is longer than model 'tiny-llama' covers" in (
        capsys.readouterr().err
    )


def test_plan_shares_train_defaults_sorts_best_first_and_completes_the_command(capsys):
    """Unset, ``--dtype`` is bf16 on a GPU (fp32 with ``--device cpu``) and ``--micro-batch-size`` is
    train's for the model (1 for a model directory or named shape, 8 for a preset); rows come best first
    (the first is the recommendation), the table prints the best 10 and says how many more; the
    recommended command carries ``--data <your data>`` and train's default ``--lr``, a note says so."""
    argv = ("--model", "llama-8b", "--gpus", "4", "--seq-len", "65536")
    doc = _plan(capsys, *argv)
    assert doc["dtype"] == "bf16" and {c["settings"]["micro_batch_size"] for c in doc["candidates"]} == {1}
    rows = doc["candidates"]
    assert rows[0] is not None and rows[0] == doc["recommended"]
    fits = [c["fits"] for c in rows]
    assert fits == sorted(fits, reverse=True) and fits[0]  # every fitting row before the others
    speeds = [c["tokens_per_s"] for c in rows if c["fits"]]
    assert speeds == sorted(speeds, reverse=True)  # fastest first
    assert doc["command"] == [*doc["recommended"]["train_args"], "--data", "<your data>", "--lr", "1e-05"]
    assert any(n.startswith("the command sets --lr 1e-05") and "<your data>" in n for n in doc["notes"])
    main(["plan", *argv])
    table = capsys.readouterr().out.splitlines()
    listed = table[1:table.index("")]
    assert len(listed) == 11 and listed[-1] == f"... {len(rows) - 10} more setting(s): --all prints every row, --json every candidate"
    assert "  " + " ".join(doc["command"]) in table
    main(["plan", *argv, "--all"])
    assert capsys.readouterr().out.splitlines().index("") == len(rows) + 1
    cpu = _plan(capsys, "--model", "tiny-llama", "--device", "cpu", "--memory", "1GB", "--seq-len", "64")
    assert cpu["dtype"] == "fp32" and cpu["recommended"]["settings"]["micro_batch_size"] == 8
    assert cpu["command"][-2:] == ["--lr", "0.01"] and "--data" not in cpu["command"]


def test_plan_names_the_tokenizer_a_model_dir_without_one_needs(capsys, tmp_path):
    """train refuses a model directory without tokenizer files unless --tokenizer names one: the plan's
    command carries the placeholder and a note, so the command it prints is one train accepts once filled."""
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256).save_pretrained(tmp_path)  # fmt: skip
    doc = _plan(capsys, "--model", str(tmp_path), "--gpus", "2", "--seq-len", "2048")
    i = doc["command"].index("--tokenizer")
    assert doc["command"][i + 1] == "<tokenizer dir>"
    assert any("has no tokenizer files" in n and "--tokenizer byte" in n for n in doc["notes"])


def test_the_readme_alst_numbers_come_from_the_commands_next_to_them(capsys):
    """Each ``ulysses-sp plan ... # N: ...`` line of the docs (the CLI guide, docs/readme/cli.md): N
    is the longest S of a row of that command with every technique and the model states on the host."""
    import re
    import shlex

    from docs_pages import all_text

    found = re.findall(r"^ulysses-sp plan (--model llama-8b [^#\n]+?)\s+# ([\d,]+): ", all_text(), flags=re.M)
    lines = sorted(set(found))
    assert len(lines) == 3, lines
    for argv, number in lines:
        doc = _plan(capsys, *shlex.split(argv))
        full = [c for c in _host_rows(doc) if c["settings"].get("offload_activations")]
        assert int(number.replace(",", "")) in {c["max_seq_len"] for c in full}, (argv, number)


def test_the_longest_length_is_bounded_by_the_node_host_memory(capsys):
    """``--host-memory``: the offloaded layer inputs of a node's 8 ranks must fit it too. Llama-8B's
    bf16 layer inputs are 256 KiB per token on the host: 500 GB holds under 2M tokens per node."""
    argv = ("--model", "llama-8b", "--gpus", "8", "--dtype", "bf16", "--offload-states")

    def longest(doc: dict) -> int:
        return max(c["max_seq_len"] for c in doc["candidates"] if c["settings"].get("offload_activations"))

    roomy, small = longest(_plan(capsys, *argv)), longest(_plan(capsys, *argv, "--host-memory", "500GB"))
    assert small < 500 * 10**9 // (256 * 1024) < roomy, (small, roomy)


def test_a_routed_experts_model_is_planned_with_a_note_on_the_experts_kernel(capsys, tmp_path):
    """The planner counts routed experts as transformers' grouped experts hold them (``ModelShape.routed``); a plan
    for a model with top-k experts says so, that another kernel holds another set, and names --rehearse; a dense
    model's plan does not."""
    from transformers import AutoConfig

    tiny = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                num_hidden_layers=2, vocab_size=256)  # fmt: skip
    for name, config in (("moe", AutoConfig.for_model("qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                                        moe_intermediate_size=32, **tiny)),
                         ("dense", AutoConfig.for_model("llama", **tiny))):  # fmt: skip
        config.save_pretrained(tmp_path / name)
    notes = {name: _plan(capsys, "--model", str(tmp_path / name), "--gpus", "2")["notes"] for name in ("moe", "dense")}
    assert any("routed experts (top-2 of 8)" in n and "--rehearse" in n for n in notes["moe"]), notes["moe"]
    assert not any("routed experts" in n for n in notes["dense"]), notes["dense"]
