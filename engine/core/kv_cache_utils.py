"""Block hashing for prefix caching.

Block ``i`` of a sequence is identified by
``sha256(parent_hash || token ids of block i || extra keys)``, so equal hashes
mean equal whole prefixes (the chain), not just equal blocks. sha256 of a
canonical byte encoding is used instead of Python's ``hash()``: the latter is
salted per process and collides on purpose-built inputs.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

#: Parent of a sequence's first block.
ROOT_BLOCK_HASH: BlockHash = b"\x00" * 32


def hash_block_tokens(parent_hash: BlockHash, token_ids: Sequence[int],
                      extra_keys: tuple[str, ...] = ()) -> BlockHash:
    """Hash one full block of token ids, chained to the hash of the block before.

    Args:
        parent_hash: hash of the previous block, or ``ROOT_BLOCK_HASH``.
        token_ids: the block's ``block_size`` token ids.
        extra_keys: anything else that changes the K/V of these tokens (e.g. a LoRA id).

    Returns:
        32-byte sha256 digest.
    """
    digest = hashlib.sha256(parent_hash)
    digest.update(array("q", token_ids).tobytes())
    for key in extra_keys:
        digest.update(b"\x00" + key.encode())
    return digest.digest()


def hash_new_full_blocks(token_ids: Sequence[int], block_hashes: list[BlockHash],
                         block_size: int, extra_keys: tuple[str, ...] = ()) -> None:
    """Append to ``block_hashes`` the hashes of blocks of ``token_ids`` that became full, each with
    ``extra_keys`` (``hash_block_tokens``).

    Cost is proportional to the new blocks only, so it can run on every
    appended token.
    """
    num_full_blocks = len(token_ids) // block_size
    for i in range(len(block_hashes), num_full_blocks):
        parent = block_hashes[i - 1] if i > 0 else ROOT_BLOCK_HASH
        block_hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys))
