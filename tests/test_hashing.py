"""The reference hasher matches its written spec and is the same in every process."""

import os
import subprocess
import sys

import blake3
import pytest
from kvstore_client.common.hashing import block_keys, chain_key
from kvstore_client.errors import InvalidArgument

V1 = "cf4b3aadefde2215ef0bd82688eac3d6"


def test_vectors_from_docs():
    k1 = chain_key(None, [1, 2, 3, 4])
    assert k1.hex() == V1
    assert chain_key(k1, [5, 6, 7, 8]).hex() == "1d554afac18f8b53e0923b7b6fa5ddaf"
    assert chain_key(None, [0, 2**32 - 1, 42, 7], extra_keys=["lora:alpha", b"\x01\x02"]).hex() \
        == "a67de6733588631be7dce277a71a6c52"
    assert [k.hex() for k in block_keys(list(range(10)), 4)] == [
        "612bef39799183ec1bee97c4f4995c10", "e0e1755d73cfd3a28292f5de1467dc60"]
    assert chain_key(None, [1, 2, 3, 4], key_bytes=32).hex() == (
        "cf4b3aadefde2215ef0bd82688eac3d601a9f4e59a2ee5de5d927e0a1313494c")


def test_spec_message_layout_by_hand():
    msg = (b"kvstore-prefix-v1\x00" + b"\x00" + (4).to_bytes(4, "little")
           + b"".join(t.to_bytes(4, "little") for t in (1, 2, 3, 4)) + (0).to_bytes(4, "little"))
    assert blake3.blake3(msg).digest(16).hex() == V1


def test_chain_is_prefix_sensitive_and_only_full_blocks():
    a = block_keys([1] * 8 + [2] * 8, 8)
    b = block_keys([3] * 8 + [2] * 8, 8)
    assert a[1] != b[1]                      # same block tokens, different prefix
    assert block_keys(list(range(15)), 8) == block_keys(list(range(8)), 8)
    assert block_keys(list(range(7)), 8) == []
    assert block_keys([1] * 16, 8, extra_keys=["lora"]) != block_keys([1] * 16, 8)
    per_block = block_keys([1] * 16, 8, block_extra_keys=[[], [b"img"]])
    assert per_block[0] == block_keys([1] * 16, 8)[0] and per_block[1] != block_keys([1] * 16, 8)[1]


def test_continuing_a_chain_with_parent_matches_whole_prompt():
    toks = list(range(40))
    whole = block_keys(toks, 8)
    tail = block_keys(toks[16:], 8, parent=whole[1])
    assert whole[2:] == tail


@pytest.mark.parametrize("bad", [[-1], [2**32], [[1, 2]], [1.5]])
def test_bad_tokens_are_rejected(bad):
    with pytest.raises(InvalidArgument):
        block_keys(bad * 8 if bad and not isinstance(bad[0], list) else bad, 1)


def test_every_sequence_type_gives_the_same_keys():
    """A list takes the C fast path (array("I")), anything else numpy's: the keys must not
    depend on which, nor on the integer width of an array."""
    import numpy as np
    toks = [0, 2**32 - 1, *range(1, 39)]
    want = block_keys(toks, 8)
    assert len(want) == 5
    for same in (tuple(toks), np.array(toks, dtype=np.int64), np.array(toks, dtype=np.uint32),
                 [np.int64(t) for t in toks]):
        assert block_keys(same, 8) == want, type(same)
    assert block_keys(range(40), 8) == block_keys(list(range(40)), 8)
    assert block_keys(toks + [2**40], 8) == want      # a partial block is neither hashed nor read


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, None, "7"])
def test_a_bad_token_in_a_list_is_named_as_numpy_names_it(bad):
    import numpy as np
    toks = [1] * 7 + [bad]
    with pytest.raises(InvalidArgument) as from_list:
        block_keys(toks, 8)
    with pytest.raises(InvalidArgument) as from_array:
        block_keys(np.asarray(toks), 8)
    assert str(from_list.value) == str(from_array.value)


def test_bad_parameters_are_rejected():
    with pytest.raises(InvalidArgument):
        block_keys([1, 2], 0)
    with pytest.raises(InvalidArgument):
        block_keys([1, 2], 1, key_bytes=8)


def test_same_keys_in_processes_with_different_hash_seeds():
    code = ("from kvstore_client.common.hashing import block_keys;"
            "print(','.join(k.hex() for k in block_keys(list(range(100)), 16, "
            "extra_keys=['lora-x'])))")
    outs = set()
    for seed in ("1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout.strip())
    assert len(outs) == 1
    assert outs.pop().split(",") == [k.hex() for k in block_keys(list(range(100)), 16,
                                                                  extra_keys=["lora-x"])]
