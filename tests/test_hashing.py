"""``hpcgnn.hashing``, the one module of counter-based hashes, against independent references:
published SplitMix64 outputs, and the numpy lowbias32 of ``tests/test_codecs.py``."""
import numpy as np
import torch

from hpcgnn import hashing
from test_codecs import np_col, np_hash32
from test_exchange_exact import mix as mix_reference


def test_splitmix64_matches_the_published_sequence():
    # SplitMix64 seeded with 0: its outputs are splitmix64(k * golden64) for k = 0, 1, 2 ...
    # (the first values of the reference generator of Steele, Lea and Flood)
    assert hashing.splitmix64(0) == 0xE220A8397B1DCDAF
    assert hashing.splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4


def test_mix_is_a_splitmix_chain_in_63_bits():
    for values in [(3, 1, 4), (0,), (2**64 - 1, 7, 2**40)]:
        assert hashing.mix(*values) == mix_reference(*values) < 2**63


def test_lowbias32_tensor_inplace_and_int_agree_with_numpy():
    x = np.array([0, 1, 2, 0xFFFFFFFF, 0x80000000, 123456789, 0xDEADBEEF], dtype=np.uint64)
    want = np_hash32(x)
    t = torch.tensor(x.astype(np.int64))
    assert np.array_equal(hashing.hash32(t).numpy().astype(np.uint64), want)
    assert np.array_equal(hashing.hash32_(t.clone()).numpy().astype(np.uint64), want)
    assert [hashing.hash32_int(int(v)) for v in x] == [int(v) for v in want]


def test_column_seeds():
    assert np.array_equal(hashing.col_seeds(9, "cpu").numpy().astype(np.uint64), np_col(np.arange(9)))
    golden = np_hash32((np.arange(9, dtype=np.uint64) * np.uint64(0x9E3779B1)) & np.uint64(0xFFFFFFFF))
    assert np.array_equal(hashing.golden_hashes(9, "cpu").numpy().astype(np.uint64), golden)


def test_lower_modules_use_this_one():
    from hpcgnn.codecs import rng
    from hpcgnn.comm import keys
    assert keys.mix is hashing.mix and keys.splitmix64 is hashing.splitmix64
    assert rng.hash32 is hashing.hash32 and rng.col_seeds is hashing.col_seeds


def test_the_node_bound_keeps_ids_within_the_dropout_node_key():
    """The dropout masks key on a node's global id modulo 2^32 (``nn.dropout``: a bijection of
    the ids below 2^32, so no two nodes share a mask); ids 2^32 apart share one. Preprocessing,
    the only writer of shard sets, refuses more than ``MAX_NODES`` nodes (ids ``0 .. N - 1``):
    the bound must stay at or below 2^32 for the masks to stay distinct."""
    from hpcgnn.data.clean import MAX_NODES
    from hpcgnn.nn.dropout import keep_mask
    mask = keep_mask(torch.tensor([5, 5 + 2**32, 6]), 256, 0.5, 1, 2, 3)
    assert torch.equal(mask[0], mask[1]) and not torch.equal(mask[0], mask[2])   # the wrap
    assert MAX_NODES <= 2**32
