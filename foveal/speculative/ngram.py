"""N-gram prompt lookup: draft tokens for a request from its own earlier text (vLLM's `ngram` method).

Owns one request's index of its tokens (prompt, then the accepted outputs as they come) and the proposal:
take the last n tokens, find their most recent earlier occurrence, and propose what followed it. Longer
n-grams are tried first (max_n down to min_n); they are rarer, so a match is better evidence.

The index is incremental: for each n a dict maps an n-gram to the end of its latest occurrence whose
continuation is known, i.e. one that ends before the current last token. Appending a token registers the
n-grams ending just before it, so extend costs O(max_n - min_n + 1) dict updates per token (tuple keys of
n <= max_n tokens; max_n is small) and propose O(max_n), independent of the sequence length.

    tokens  a b c d a b c        propose(k=3), n = 3: suffix (a b c) last ended at 3 -> [d a b]
    end         ^3

It must not know about models or schedulers: callers feed it token ids and ask for k proposals.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Per request: an incremental index of the request's own tokens (prompt + output) that proposes, for the
    current last tokens, what followed their most recent earlier occurrence."""

    def __init__(self, min_n: int, max_n: int):
        if min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n must be >= min_n ({min_n}), got {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._tokens: list[int] = []
        # _ends[n - min_n][gram] = e: the latest occurrence of gram is tokens[e - n : e], with e < len
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens (the prompt first, then accepted outputs as they come)."""
        toks = self._tokens
        lo = self.min_n
        for t in tokens:
            e = len(toks)  # the n-grams ending here now have a continuation: t
            toks.append(t)
            for i, ends in enumerate(self._ends):
                n = lo + i
                if n > e:
                    break
                ends[tuple(toks[e - n : e])] = e

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix
        (fewer where that occurrence is near the end); [] with no match."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        toks = self._tokens
        L = len(toks)
        if k == 0:
            return []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            e = self._ends[n - self.min_n].get(tuple(toks[L - n :]))
            if e is not None:
                return toks[e : e + k]
        return []
