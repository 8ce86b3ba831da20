"""The TTT loss: the fast version equals the by-hand reference, and the shift is the right one."""

from __future__ import annotations

import pytest
import torch

from eyas.data.features import Teacher
from eyas.train.loss import BatchTeacher, step_valid, summarise, ttt_loss
from reference_ttt import DenseTeacher, ttt_loss_reference
from test_train_fixtures import draft_vocab_from, tiny_batch, tiny_head, tiny_ids, tiny_target


@pytest.fixture(scope="module")
def parts():
    model = tiny_target()
    d2t, t2d = draft_vocab_from(model, tiny_ids(model), size=8)
    head = tiny_head(model, d2t, t2d)
    batch, teacher = tiny_batch(model, d2t, t2d)
    return model, head, batch, teacher


def assert_same(fast, ref):
    torch.testing.assert_close(fast.step_losses, ref.step_losses, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.loss.detach(), ref.loss.detach(), atol=1e-5, rtol=1e-5)
    assert fast.step_count.tolist() == ref.step_count.tolist()
    assert fast.step_correct.tolist() == ref.step_correct.tolist()
    assert (int(fast.accepted), int(fast.positions)) == (int(ref.accepted), int(ref.positions))


def test_fast_equals_reference_dense(parts):
    model, head, batch, teacher = parts
    w = model.get_input_embeddings().weight
    fast = ttt_loss(head, w, batch, teacher, ttt_steps=4)
    ref = ttt_loss_reference(head, w, batch, teacher, ttt_steps=4)
    assert_same(fast, ref)
    # The comparison has teeth: positions were dropped by the mask, some argmaxes hit, tau_sim has positions.
    assert 0 < fast.step_count[0] < batch["input_ids"].numel() - 2
    assert fast.step_correct.sum() > 0 and fast.positions > 0


def test_fast_equals_reference_gradients(parts):
    model, head, batch, teacher = parts
    w = model.get_input_embeddings().weight
    grads = []
    for fn in (ttt_loss, ttt_loss_reference):
        head.zero_grad()
        fn(head, w, batch, teacher, ttt_steps=3).loss.backward()
        grads.append({n: p.grad.clone() for n, p in head.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_fast_equals_reference_sparse_topk(parts):
    model, head, batch, teacher = parts
    top_logits, top_ids = teacher.logits.topk(3, dim=-1)
    fields = {"teacher_topk_ids": top_ids, "teacher_topk_logits": top_logits}
    sparse = BatchTeacher(Teacher(None, None, draft_vocab_size=8), fields)
    w = model.get_input_embeddings().weight
    assert_same(ttt_loss(head, w, batch, sparse, ttt_steps=3), ttt_loss_reference(head, w, batch, sparse, ttt_steps=3))


def test_unshifted_loss_mask_is_detected(parts):
    """The known bug elsewhere: the loss mask read at t+k+1 instead of t+k+2. The reference with it must differ."""
    model, head, batch, teacher = parts
    w = model.get_input_embeddings().weight
    fast = ttt_loss(head, w, batch, teacher, ttt_steps=3)
    buggy = ttt_loss_reference(head, w, batch, teacher, ttt_steps=3, target_shift=1)
    assert fast.step_count.tolist() != buggy.step_count.tolist()
    assert not torch.allclose(fast.step_losses, buggy.step_losses, atol=1e-4)


def test_step_valid_reads_mask_two_ahead_and_teacher_one_ahead():
    seq = 10
    batch = {"loss_mask": torch.zeros(1, seq, dtype=torch.long), "attention_mask": torch.ones(1, seq, dtype=torch.bool),
             "target_in_draft": torch.ones(1, seq, dtype=torch.bool)}
    batch["loss_mask"][0, 7] = 1
    for k in range(3):  # token 7 is predicted from position 7-k-2 at step k
        assert step_valid(batch, k)[0].nonzero().flatten().tolist() == [7 - k - 2]
    batch["target_in_draft"][0, 5] = False  # the teacher at 5 predicts token 6, which is not trained anyway
    assert all(step_valid(batch, k).any() for k in range(3))
    batch["target_in_draft"][0, 6] = False  # token 7's teacher (position 6) is outside the draft vocab
    assert not any(step_valid(batch, k).any() for k in range(3))
    batch["target_in_draft"][0, 6] = True
    batch["attention_mask"][0, 7] = False  # padding never trains
    assert not any(step_valid(batch, k).any() for k in range(3))


def test_perfect_draft_has_full_acceptance(parts):
    """A teacher equal to the head's own step logits makes every step correct: tau_sim = 1 + K."""
    model, head, batch, _ = parts
    w = model.get_input_embeddings().weight
    k_steps = 3
    # A zero final-norm weight makes every draft logit 0; argmax then returns the first id (documented).
    with torch.no_grad():
        saved = head.norm.weight.clone()
        head.norm.weight.zero_()
    try:
        teacher_logits = torch.zeros(*batch["input_ids"].shape, 8)
        teacher_logits[..., 0] = 5.0
        out = ttt_loss(head, w, batch, DenseTeacher(teacher_logits), ttt_steps=k_steps)
        stats = summarise(out.counters(), k_steps)
        assert stats["step_acc"] == [1.0] * k_steps
        assert stats["tau_sim"] == 1.0 + k_steps
        teacher_logits[..., 0] = -5.0  # now the first step always misses: tau_sim = 1
        out = ttt_loss(head, w, batch, DenseTeacher(teacher_logits), ttt_steps=k_steps)
        assert summarise(out.counters(), k_steps)["tau_sim"] == 1.0
    finally:
        with torch.no_grad():
            head.norm.weight.copy_(saved)


def test_draft_losses_are_what_they_say():
    from eyas.train.loss import draft_loss

    torch.manual_seed(0)
    logits = torch.randn(5, 11, requires_grad=True)
    teacher = torch.randn(5, 11).softmax(-1)
    argmax = teacher.argmax(-1)
    q = logits.softmax(-1)
    kl = draft_loss("kl", logits, teacher, argmax)
    assert torch.allclose(kl, -(teacher * q.log()).sum(-1), atol=1e-6)
    assert torch.allclose(draft_loss("hard", logits, teacher, argmax), -q.log()[torch.arange(5), argmax], atol=1e-6)
    lk = draft_loss("lk", logits, teacher, argmax)
    assert torch.allclose(lk, -torch.minimum(q, teacher).sum(-1).log(), atol=1e-6)
    assert torch.allclose(draft_loss("kl+lk", logits, teacher, argmax), kl + lk, atol=1e-6)
    # A draft equal to the teacher is always accepted: lk is 0 there, and positive anywhere else.
    assert draft_loss("lk", teacher.log(), teacher, argmax).abs().max() < 1e-5 and (lk > 0).all()
    lk.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("loss", ["hard", "lk", "kl+lk"])
def test_every_loss_trains_through_ttt(parts, loss):
    model, head, batch, teacher = parts
    w = model.get_input_embeddings().weight
    out = ttt_loss(head, w, batch, teacher, ttt_steps=3, loss=loss)
    out.loss.backward()
    grads = [p.grad for p in head.parameters() if p.grad is not None]
    assert torch.isfinite(out.loss) and grads and all(torch.isfinite(g).all() for g in grads)
    head.zero_grad()


def test_hidden_regression_term_is_the_normed_output_against_the_next_positions_final_hidden(parts):
    """train.hidden_loss_weight: at TTT step 0, position t's normed output is compared with the target's final
    hidden state at t+1 (the position whose distribution it is trained towards), and nowhere else."""
    from eyas.heads.eagle3 import embed
    from eyas.train.loss import hidden_regression

    model, head, batch, teacher = parts
    w = model.get_input_embeddings().weight
    g = torch.Generator().manual_seed(5)
    final = torch.randn(*batch["input_ids"].shape, head.config.hidden_size, generator=g)
    batch = dict(batch, teacher_hidden=final)
    plain = ttt_loss(head, w, batch, teacher, ttt_steps=1)
    with_hidden = ttt_loss(head, w, batch, teacher, ttt_steps=1, hidden_weight=0.5)

    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    _, out = head(batch["aux"], embed(w, torch.cat([ids[:, 1:], ids[:, :1] * 0], 1)), positions)
    b, t = step_valid(batch, 0).nonzero(as_tuple=True)
    by_hand = hidden_regression(head, out[b, t], final[b, t + 1]).mean()
    torch.testing.assert_close(with_hidden.loss - plain.loss, 0.5 * by_hand, atol=1e-5, rtol=1e-5)
    shifted = hidden_regression(head, out[b, t], final[b, t]).mean()
    assert (by_hand - shifted).abs() > 1e-3  # the shift is tested: the same position would give another value
    # Zero where the normed output is the target's final hidden state, and it trains every part of the head.
    assert hidden_regression(head, out[b, t], head.norm(out[b, t])).abs().max() < 1e-6
    head.zero_grad()
    ttt_loss(head, w, batch, teacher, ttt_steps=2, hidden_weight=1.0).loss.backward()
    assert head.norm.weight.grad.abs().sum() > 0 and head.fc.weight.grad.abs().sum() > 0
    head.zero_grad()


def test_hidden_regression_needs_the_final_hidden_states(parts):
    model, head, batch, teacher = parts
    with pytest.raises(KeyError, match="hidden_loss_weight needs the target's final hidden states"):
        ttt_loss(head, model.get_input_embeddings().weight, batch, teacher, ttt_steps=1, hidden_weight=1.0)
