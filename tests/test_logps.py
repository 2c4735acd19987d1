"""``sequence_logps`` (issue 34 item 1): per-token log-probs, entropies and per-sequence / per-document
sums under SP equal the same quantities computed without SP from the full logits, and so do the
gradients of preference- and RL-style losses built from them (summed over the SP group, as the engine
and the Trainer's FSDP/DDP reduce them).

The losses mix every way a trainer uses the values: a DPO-style term on per-sequence sums, a
GRPO-style token-level term on the gathered per-token log-probs with per-token advantages and a
batch-wide normaliser, an entropy bonus, and a term on per-document sums (documents marked by
positions restarting at 0, one of them across the shard boundary). Oracle: the plain model on the
full sequence, ``log_softmax`` of its full logits. A broken all-reduce (gradient ``sp`` times too large
through a differentiable sum), a gather whose backward sums, or a wrong document offset fails it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import global_batch, shift, tiny_model

VOCAB, B, S, T = 256, 2, 16, 0.7
DOC_POS = torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)])  # row 1's documents: 5, 7 (spans 8), 4


def _data():
    ids = global_batch(3, B, S, VOCAB)
    labels = shift(ids)
    labels[0, :3] = -100  # a prompt
    labels[1, 4] = labels[1, 11] = -100  # each document's last token predicts nothing
    pos = torch.stack([torch.arange(S), DOC_POS])  # row 0 one document, row 1 three
    adv = torch.linspace(-1, 1, S).expand(B, S)  # per-token advantages
    return ids, labels, pos, adv


def _loss(sums, doc_sums, doc_counts, tok, ent, mask, adv):
    """One scalar from every kind of value: what a DPO / GRPO / per-document objective does with them."""
    dpo = -F.logsigmoid(0.1 * (sums[0] - sums[1]))
    grpo = -(tok * adv * mask).sum() / mask.sum()  # token-level, normalised over the batch
    bonus = -0.01 * (ent * mask).sum() / mask.sum()
    per_doc = ((doc_sums / doc_counts.clamp(min=1)) ** 2).sum() * 0.01
    return dpo + grpo + bonus + per_doc


def _reference():
    model = tiny_model("llama", vocab=VOCAB)
    ids, labels, pos, adv = _data()
    logits = model(input_ids=ids).logits.float() / T  # [B, S, V]
    logp = logits.log_softmax(-1)
    mask = labels != -100
    tok = logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask  # [B, S]
    ent = -(logp.exp() * logp).sum(-1) * mask
    doc = (pos == 0).cumsum(1) - 1  # [B, S] document index within the row
    doc_sums = torch.zeros(B, 3).scatter_add(1, doc, tok)
    doc_counts = torch.zeros(B, 3).scatter_add(1, doc, mask.float())
    loss = _loss(tok.sum(1), doc_sums, doc_counts, tok, ent, mask, adv)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return tok.detach(), ent.detach(), doc_sums.detach(), doc_counts, loss.detach(), grads


def _sp_run(sp: int, use_head: bool):
    from ulysses_sp import model_logps, sequence_logps
    from ulysses_sp.attention.ulysses import UlyssesSPAttentionHF
    from ulysses_sp.parallel.mesh import init_mesh

    world = dist.get_world_size()
    mesh = init_mesh((world // sp, sp))
    model = tiny_model("llama", vocab=VOCAB)
    reg = UlyssesSPAttentionHF.register_with_transformers(model, "eager", sp, B, mesh=mesh)
    group = reg.get_sequence_parallel_group()
    ids, labels, pos, adv = _data()
    s_l, k = S // sp, mesh.sp_rank
    cols = slice(k * s_l, (k + 1) * s_l)
    batch = {"input_ids": ids[:, cols], "position_ids": torch.arange(S)[cols].expand(B, -1)}
    if use_head:  # the tiled path through the model's own call
        rows = model_logps(model, batch, labels[:, cols], group, temperature=T, entropy=True, num_shards=3)
    else:  # logits the caller already has
        rows = sequence_logps(model(**batch).logits, None, labels[:, cols], group, temperature=T, entropy=True)
    docs = model_logps(model, batch, labels[:, cols], group, position_ids=pos[:, cols], temperature=T)
    full_tok, full_ent, full_mask = rows.gather(), rows.gather(rows.entropy), rows.gather(rows.mask)
    loss = _loss(rows.sums, docs.sums, docs.counts, full_tok, full_ent, full_mask, adv)
    loss.backward()
    for p in model.parameters():  # the gradient contract: sum over the SP group
        dist.all_reduce(p.grad, group=group)
    reg.remove()
    out = (rows.token_logps, rows.entropy, rows.sums, rows.counts, docs.sums, docs.counts, full_tok, loss)
    return [t.detach() for t in out], {n: p.grad for n, p in model.named_parameters()}, k


@pytest.mark.parametrize("world, sp, use_head", [(2, 2, True), (2, 2, False), (4, 4, True), (4, 2, True)])
def test_sequence_logps_and_their_gradients_equal_the_no_sp_computation(pool, world, sp, use_head):
    tok, ent, doc_sums, doc_counts, loss, grads = _reference()
    mask = _data()[1] != -100
    for values, sp_grads, k in pool.run(_sp_run, world, sp, use_head):
        s_l = S // sp
        cols = slice(k * s_l, (k + 1) * s_l)
        t, e, sums, counts, d_sums, d_counts, full, sp_loss = values
        torch.testing.assert_close(t, tok[:, cols], rtol=1e-5, atol=1e-5)  # every position of the shard
        torch.testing.assert_close(e, ent[:, cols], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sums, tok.sum(1), rtol=1e-5, atol=1e-5)  # the whole sequence's
        assert counts.tolist() == mask.sum(1).float().tolist()
        torch.testing.assert_close(d_sums, doc_sums, rtol=1e-5, atol=1e-5)  # per document, across shards
        assert d_counts.tolist() == doc_counts.tolist()
        torch.testing.assert_close(full, tok, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sp_loss, loss, rtol=1e-5, atol=1e-6)
        for name, g in grads.items():
            torch.testing.assert_close(sp_grads[name], g, rtol=1e-4, atol=1e-6 * float(g.abs().max()), msg=name)


def test_without_sp_sequence_logps_is_the_plain_log_softmax_and_refuses_bad_shapes():
    from ulysses_sp import sequence_logps

    tok, ent, doc_sums, _, _, _ = _reference()
    model = tiny_model("llama", vocab=VOCAB)
    ids, labels, pos, _ = _data()
    hidden = model.model(input_ids=ids).last_hidden_state
    got = sequence_logps(hidden, model.lm_head, labels, None, position_ids=pos, temperature=T, entropy=True)
    torch.testing.assert_close(got.token_logps, tok, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.sums, doc_sums, rtol=1e-5, atol=1e-5)
    assert got.gather() is got.token_logps  # no group: nothing to gather
    with pytest.raises(ValueError, match=r"hidden_states \(2, 16, 32\) and shift_labels \(2, 15\) disagree"):
        sequence_logps(hidden, model.lm_head, labels[:, 1:], None)
    with pytest.raises(ValueError, match="temperature must be positive, got 0"):
        sequence_logps(hidden, model.lm_head, labels, None, temperature=0)


def test_the_logits_are_never_whole_with_a_head(monkeypatch):
    """Tiled: the output projection only ever sees a tile of the shard (``[B, S_l / n, h]``)."""
    from ulysses_sp import sequence_logps

    model = tiny_model("llama", vocab=VOCAB)
    ids, labels, _, _ = _data()
    hidden = model.model(input_ids=ids).last_hidden_state.detach().requires_grad_()
    seen = []
    seen_forward = model.lm_head.forward

    def spy(x):
        seen.append(x.shape[1])
        return seen_forward(x)

    monkeypatch.setattr(model.lm_head, "forward", spy)
    out = sequence_logps(hidden, model.lm_head, labels, None, num_shards=4)
    out.sums.sum().backward()
    assert seen and max(seen) == S // 4  # forward and backward recompute: one tile at a time
    assert copy.copy(hidden.grad).abs().sum() > 0
