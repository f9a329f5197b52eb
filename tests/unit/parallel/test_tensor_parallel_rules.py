"""apply_tensor_parallel refuses a model it cannot split, naming the rule, before any collective."""

import pytest

from loom.models import TransformerArgs, build_model
from loom.parallel.tensor import apply_tensor_parallel


class _Mesh:  # only .size() is consulted before the rules are checked
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def _model(**kw):
    base = dict(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=128)
    return build_model(TransformerArgs(**{**base, **kw}), device="meta")


@pytest.mark.parametrize("tp, kw, field", [
    (4, {}, "n_kv_heads=2"),                                    # GQA: kv heads bind first
    (3, {"n_kv_heads": 4, "dim": 48, "ffn_dim": 96}, "n_kv_heads=4"),
    (2, {"ffn_dim": 129}, "ffn_dim=129"),
    (2, {"vocab_size": 129}, "vocab_size=129"),
])
def test_indivisible_shapes_are_rejected_with_the_rule(tp, kw, field):
    with pytest.raises(ValueError, match=rf"tp={tp} must divide model\.{field}.*valid tp degrees"):
        apply_tensor_parallel(_model(**kw), _Mesh(tp), sequence_parallel=False, vocab_parallel=True)


def test_vocab_size_is_free_without_vocab_parallelism_and_degree_one_is_identity():
    model = _model(vocab_size=129)
    with pytest.raises(ValueError, match="n_kv_heads"):  # vocab not checked; heads still are
        apply_tensor_parallel(model, _Mesh(4), sequence_parallel=False, vocab_parallel=False)
    assert apply_tensor_parallel(model, _Mesh(1), sequence_parallel=True,
                                 vocab_parallel=True) is model


def test_tied_embeddings_need_vocab_parallelism():
    with pytest.raises(ValueError, match="tie_embeddings needs vocab_parallel=True"):
        apply_tensor_parallel(_model(tie_embeddings=True), _Mesh(2), sequence_parallel=False,
                              vocab_parallel=False)
