"""Layout validation and namespace identity."""

import pytest
from kvstore_client import InvalidArgument, KVLayout, NamespaceSpec


def test_block_bytes_and_shape():
    lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16, dtype="float16")
    assert lay.block_shape == (4, 2, 16, 2, 64)
    assert lay.block_bytes == 4 * 2 * 16 * 2 * 64 * 2


@pytest.mark.parametrize("kw,msg", [
    ({"num_layers": 0}, "num_layers must be positive"),
    ({"head_dim": -3}, "head_dim must be positive"),
    ({"block_tokens": 2.5}, "must be an integer"),
    ({"dtype": "int4"}, "unknown dtype"),
    ({"num_layers": 1000, "num_kv_heads": 64, "head_dim": 256, "block_tokens": 512},
     "above the"),
])
def test_bad_layouts_name_the_problem(kw, msg):
    args = dict(num_layers=2, num_kv_heads=2, head_dim=8, block_tokens=4, dtype="bfloat16")
    args.update(kw)
    with pytest.raises(InvalidArgument, match=msg):
        KVLayout(**args)


def test_namespace_digest_is_stable_and_discriminating():
    lay = KVLayout(2, 2, 8, 4, "bfloat16")
    a = NamespaceSpec(model="m", layout=lay)
    assert a.digest == NamespaceSpec(model="m", layout=KVLayout(2, 2, 8, 4, "bfloat16")).digest
    assert len(a.digest) == 16
    # A value computed once and written down: the digest must never drift between versions.
    pinned = "f3ab0343573ccffac7536c4c3366ec97"
    assert a.digest.hex() == NamespaceSpec.from_dict(a.to_dict()).digest.hex() == pinned
    others = [NamespaceSpec(model="m2", layout=lay),
              NamespaceSpec(model="m", layout=lay, revision="r"),
              NamespaceSpec(model="m", layout=lay, shard_rank=1, shard_size=2),
              NamespaceSpec(model="m", layout=lay, tenant_salt="t"),
              NamespaceSpec(model="m", layout=lay, codec="int8"),
              NamespaceSpec(model="m", layout=KVLayout(2, 2, 8, 4, "float16"))]
    assert len({o.digest for o in others} | {a.digest}) == len(others) + 1


@pytest.mark.parametrize("kw", [{"model": ""}, {"codec": "zip"}, {"shard_rank": 2},
                                {"shard_size": 0}, {"hash_scheme": "md5"}])
def test_bad_namespaces(kw):
    args = dict(model="m", layout=KVLayout(2, 2, 8, 4))
    args.update(kw)
    with pytest.raises(InvalidArgument):
        NamespaceSpec(**args)
