"""Padding reads the same whatever the mask convention: a padded sequence's record is the sequence alone.

transformers' eager attention adds ``torch.finfo(dtype).min`` where a key is masked, older code adds ``-10000`` or
``-1e9``, SDPA takes booleans or ``-inf``: each must give the same key mask, and a padded sequence the diagnostics of
the same sequence alone (its padding left out of the walk, a causal layer logging no reversibility gap).
"""

import inspect
import math
import warnings

import pytest
import torch

import connmon
from connmon.capture.scores import attention_scores
from connmon.metrics import WalkMetrics
from tests.capture.families import FAMILIES, VOCAB, sharpen

transformers = pytest.importorskip("transformers", minversion="5.0")

TOKENS, PAD = 7, 3
TEXT = [f for f in FAMILIES if f.inputs == "ids"]


def eager(family):
    config = getattr(transformers, family.config_class)(**family.config)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, family.model_class)(config).eval()
    sharpen(model)
    return model


def walk_values(model, **inputs):
    """Per layer: the key mask of the first sequence and its walk diagnostics."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' config notes; a skipped layer shows as a missing record
        records = connmon.capture(model, **inputs)
    metrics = WalkMetrics(len(records))
    for record in records:
        metrics.update(record)
    values = {name: value.reshape(-1) for name, value in metrics.compute().items() if "/" not in name}
    masks = [None if r.key_mask is None else r.key_mask[0].tolist() for r in records]
    return [r.name for r in records], masks, values


def padded(side):
    ids = torch.randint(1, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(3))
    pad = torch.zeros(1, PAD, dtype=torch.long)
    batch = torch.cat([ids, pad] if side == "right" else [pad, ids], dim=1)
    keep = torch.arange(TOKENS + PAD) < TOKENS if side == "right" else torch.arange(TOKENS + PAD) >= PAD
    return ids, batch, keep.long()[None]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("family", TEXT, ids=lambda f: f.name)
def test_a_padded_sequence_in_eager_attention_reads_as_the_sequence_alone(family, side):
    model = eager(family)
    ids, batch, mask = padded(side)
    positions = {}
    if "position_ids" in inspect.signature(model.forward).parameters:  # learned positions: the same ones as alone
        positions = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        alone_positions = {"position_ids": torch.arange(TOKENS)[None]}
    names, masks, values = walk_values(model, input_ids=batch, attention_mask=mask, **positions)
    alone_names, _, alone = walk_values(
        model, input_ids=ids, attention_mask=torch.ones_like(ids), **(alone_positions if positions else {})
    )
    assert names == alone_names and names
    assert all(m == mask[0].bool().tolist() for m in masks)  # the padding is the key mask, in every layer
    for name in ("attention_entropy", "walk_spectral_gap", "reversibility_gap", "max_attention_logit"):
        close = torch.isclose(values[name], alone[name], rtol=1e-4, atol=1e-6, equal_nan=True)
        assert close.all(), (name, values[name], alone[name])
    if family.causal:
        assert values["reversibility_gap"].isnan().all()  # a causal walk logs none, padded or not


MASKS = ["long", "bool", "4d finfo.min", "4d -1e4", "4d -1e9", "4d -inf"]


def mask_of(convention, keep, causal):
    """The same padding (and causal mask) written in one of the conventions users and transformers use."""
    if convention == "long":
        return keep
    if convention == "bool":
        return keep.bool()
    n = keep.shape[-1]
    allowed = keep.bool()[:, None, None, :] & (torch.ones(n, n).tril().bool() if causal else torch.ones(n, n).bool())
    fill = {"finfo.min": torch.finfo(torch.float32).min, "-1e4": -1e4, "-1e9": -1e9, "-inf": float("-inf")}
    return torch.zeros(allowed.shape).masked_fill(~allowed, fill[convention.split()[1]])


@pytest.mark.parametrize("name", ["LLaMA", "BERT"])
def test_every_mask_convention_gives_the_same_key_mask_and_walk(name):
    family = next(f for f in FAMILIES if f.name == name)
    model = eager(family)
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    keep = torch.ones(2, 8, dtype=torch.long)
    keep[0, -3:], keep[1, :2] = 0, 0  # one sequence padded on the right, one on the left
    results = {}
    for convention in MASKS:
        if convention == "4d -inf" and family.causal:
            continue  # a left-padded query then has no finite logit: the model's own softmax gives NaN
        mask = mask_of(convention, keep, family.causal)
        with torch.no_grad():
            output = model(input_ids=ids, attention_mask=mask)[0]
        records = connmon.capture(model, input_ids=ids, attention_mask=mask)
        results[convention] = output, records
    reference_output, reference = results["long"]
    assert [r.key_mask.tolist() for r in reference] == [keep.bool().tolist()] * len(reference)
    for convention, (output, records) in results.items():
        valid = keep.bool()[..., None]  # a padding query's output depends on the fill (it attends masked keys only)
        torch.testing.assert_close(output * valid, reference_output * valid, msg=convention)
        assert len(records) == len(reference), convention
        for record, expected in zip(records, reference, strict=True):
            assert torch.equal(record.key_mask, expected.key_mask), convention
            rows = keep.bool()[:, None, :, None]  # the walk's rows are the valid queries
            torch.testing.assert_close(record.attn * rows, expected.attn * rows, msg=convention)
            assert record.reconstruction_error <= 1e-5, convention


def test_a_boolean_mask_that_eager_attention_adds_as_numbers_is_recorded_as_computed_with_a_warning():
    """transformers' eager functions add the mask: a 4D boolean one adds +1 / 0 and masks nothing. connmon says so."""
    model = eager(next(f for f in FAMILIES if f.name == "LLaMA"))
    ids = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    keep = torch.ones(1, 8, dtype=torch.long)
    keep[0, -3:] = 0
    mask = keep.bool()[:, None, None, :] & torch.ones(8, 8).tril().bool()
    with pytest.warns(UserWarning, match="adds the boolean attention mask to the scores as numbers"):
        records = connmon.capture(model, input_ids=ids, attention_mask=mask)
    assert len(records) == 2 and all(r.key_mask is None for r in records)  # it masked no key
    assert all(r.reconstruction_error <= 1e-5 for r in records)


class HandAttention(torch.nn.Module):
    """Attention by hand, a causal and padding mask filled with a chosen value before its softmax."""

    def __init__(self, fill, width=16, heads=2):
        super().__init__()
        self.fill, self.heads = fill, heads
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        allowed = keep[:, None, None, :] & torch.ones(n, n, dtype=torch.bool).tril()
        probs = torch.softmax(scores.masked_fill(~allowed, self.fill), dim=-1)
        return self.out((probs @ v).transpose(1, 2).reshape(b, n, d))


class HandModel(torch.nn.Module):
    def __init__(self, fill):
        super().__init__()
        self.attn = HandAttention(fill)

    def forward(self, x, keep):
        return self.attn(x, keep)


@pytest.mark.parametrize("fill", [-1e9, -1e4, torch.finfo(torch.float32).min], ids=str)
def test_attention_by_hand_with_a_finite_fill_reads_left_padding_as_padding(fill):
    """Left padding under a causal mask blocks every key of a padding query: its softmax of equal logits is uniform,
    and it must still read as padding (on main such a row made every key look attended)."""
    torch.manual_seed(0)
    model = HandModel(fill)
    x = torch.randn(2, 6, 16)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, :2] = False
    (record,) = connmon.capture(model, x, keep)
    assert record.key_mask.tolist() == keep.tolist()
    assert record.reconstruction_error <= 1e-6  # the uniform rows are kept as the module computed them


def test_scores_under_a_finite_mask_are_the_softmax_the_kernel_computes():
    """A dense float64 softmax of scores plus mask, against attention_scores: the same probabilities everywhere
    (a row a finite mask blocks entirely included), with the blocked keys read from the mask's values."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64), torch.randn(2, 3, 5, 4, generator=gen).double()
    mask = torch.zeros(2, 1, 5, 5, dtype=torch.float64)
    mask[0, ..., -2:] = -1e4  # right padding
    mask[1, ..., :2] = torch.finfo(torch.float32).min  # left padding ...
    mask[1] = mask[1].masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))  # ... and causal
    probs, _, allowed = attention_scores(q, k, mask)
    expected = torch.softmax(q @ k.mT / 2.0 + mask, dim=-1)
    torch.testing.assert_close(probs, expected, rtol=1e-12, atol=1e-300)
    assert allowed.any(-2).any(-2).tolist() == [[True] * 3 + [False] * 2, [False] * 2 + [True] * 3]
