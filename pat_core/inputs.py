"""Block-table input forms and their validation.

Three forms are accepted and all become one :class:`BlockTable`:

* vLLM style: an int array ``[batch, max_blocks]`` plus ``seq_lens [batch]``.  Entries past
  ``ceil(seq_len / page_size)`` are padding and ignored, whatever they hold.
* a list of per-request page lists plus ``seq_lens``.
* FlashInfer CSR: ``indptr [batch + 1]``, ``indices [nnz]``, ``last_page_len [batch]``
  (:meth:`BlockTable.from_csr`); the sequence lengths follow from the page counts.

Every error names the argument at fault.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

INT32_MAX = 2**31 - 1


def _to_numpy(x, name: str) -> np.ndarray:
    """Host array from NumPy / list / CPU torch tensor; refuse device tensors (no silent copies)."""
    if hasattr(x, "device") and hasattr(x, "cpu") and hasattr(x, "numpy"):  # torch tensor
        if str(x.device) != "cpu":
            raise TypeError(f"{name} must be a host array (NumPy or CPU tensor); got a tensor on "
                            f"{x.device}: plan() never copies device data back")
        return x.numpy()
    if hasattr(x, "__cuda_array_interface__"):
        raise TypeError(f"{name} must be a host array (NumPy or CPU tensor), not a device array")
    return np.asarray(x)


def _as_int_array(x, name: str, ndim: int | None) -> np.ndarray:
    """``x`` as a host integer array of ``ndim`` dimensions (any when ``None``); a float, an
    object (ragged, or an int past int64) or another rank raises naming ``name``."""
    arr = _to_numpy(x, name)
    if arr.dtype == object:
        raise TypeError(f"{name} must be an integer array; got ragged or mixed data")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr


def _int64(arr: np.ndarray, name: str, used=None) -> np.ndarray:
    """``arr`` as int64 (``arr`` itself when it is one: callers never write to the result);
    an unsigned entry above 2^63 - 1 (in ``used``, a bool mask, when given) is reported with
    its true value instead of wrapping to a negative number."""
    if arr.dtype.kind == "u" and arr.size:
        big = arr > np.iinfo(np.int64).max
        if used is not None:
            big &= used
        if big.any():
            at = tuple(int(i) for i in np.argwhere(big)[0])
            idx = ", ".join(map(str, at))
            raise ValueError(f"{name}[{idx}] = {int(arr[at])} does not fit in int32 "
                             f"(the limit is 2^31 - 1)")
    return arr.astype(np.int64, copy=False)


@dataclass
class BlockTable:
    """A batch's paged-KV layout, normalised.

    Attributes
    ----------
    table : int32 ``[batch, max_pages]``
        Page ids; entries at column ``>= num_pages[r]`` are ``-1``.
    seq_lens : int32 ``[batch]``
        KV length of each request, ``>= 1``.
    num_pages : int32 ``[batch]``
        ``ceil(seq_lens / page_size)``.
    page_size : int
    """

    table: np.ndarray
    seq_lens: np.ndarray
    num_pages: np.ndarray
    page_size: int

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def total_pages(self) -> int:
        return int(self.num_pages.sum())

    def pages_of(self, r: int) -> np.ndarray:
        """Page ids of request ``r`` (int32 ``[num_pages[r]]``)."""
        return self.table[r, : self.num_pages[r]]

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_padded(cls, block_tables, seq_lens, page_size: int) -> "BlockTable":
        """From a vLLM-style ``[batch, max_blocks]`` table (padding past the used pages ignored)."""
        page_size = _check_page_size(page_size)
        bt = _as_int_array(block_tables, "block_tables", 2)
        sl = _check_seq_lens(seq_lens, bt.shape[0])
        npages = ((sl.astype(np.int64) + page_size - 1) // page_size).astype(np.int32)
        width = int(npages.max()) if npages.size else 0
        if width > bt.shape[1]:
            bad = int(np.argmax(npages > bt.shape[1]))
            raise ValueError(
                f"seq_lens[{bad}] = {int(sl[bad])} needs {int(npages[bad])} pages of {page_size} "
                f"tokens but block_tables lists only {bt.shape[1]} per request")
        src = bt[:, :width]
        if src.dtype not in (np.int32, np.int64):
            used = np.arange(width)[None, :] < npages[:, None]
            src = _int64(src, "block_tables", used)
        table, bad_r, bad_c = _mask_padding(np.ascontiguousarray(src), npages)
        if bad_r >= 0:
            val = int(src[bad_r, bad_c])
            if val < 0:
                raise ValueError(f"block_tables[{bad_r}, {bad_c}] = {val} is a negative page id")
            raise ValueError(f"block_tables[{bad_r}, {bad_c}] = {val} does not fit in int32 "
                             f"(the limit is 2^31 - 1)")
        return cls(table=table, seq_lens=sl, num_pages=npages, page_size=page_size)

    @classmethod
    def from_lists(cls, block_tables, seq_lens, page_size: int) -> "BlockTable":
        """From a list of per-request page lists (each may be longer than needed)."""
        page_size = _check_page_size(page_size)
        if not isinstance(block_tables, (list, tuple)):
            raise TypeError("block_tables must be a list of page lists")
        sl = _check_seq_lens(seq_lens, len(block_tables))
        npages = ((sl.astype(np.int64) + page_size - 1) // page_size).astype(np.int32)
        width = int(npages.max()) if npages.size else 0
        table = np.full((len(block_tables), width), -1, dtype=np.int64)
        for r, row in enumerate(block_tables):
            row = _as_int_array(row, f"block_tables[{r}]", 1)
            k = int(npages[r])
            if row.shape[0] < k:
                raise ValueError(
                    f"seq_lens[{r}] = {int(sl[r])} needs {k} pages of {page_size} tokens but "
                    f"block_tables[{r}] lists {row.shape[0]}")
            table[r, :k] = row[:k]
        return cls.from_padded(table, sl, page_size)

    @classmethod
    def from_csr(cls, indptr, indices, last_page_len, page_size: int) -> "BlockTable":
        """From FlashInfer's CSR form: request ``r`` owns ``indices[indptr[r]:indptr[r+1]]`` and
        fills ``last_page_len[r]`` tokens (``1..page_size``) of its last page."""
        table, seq = csr_to_padded(indptr, indices, last_page_len, page_size)
        return cls.from_padded(table, seq, page_size)

    def to_csr(self):
        """``(indptr, indices, last_page_len)`` int32 arrays, FlashInfer's form."""
        indptr = np.zeros(self.batch_size + 1, dtype=np.int32)
        np.cumsum(self.num_pages, out=indptr[1:])
        used = np.arange(self.table.shape[1])[None, :] < self.num_pages[:, None]
        indices = self.table[used].astype(np.int32)
        last = (self.seq_lens - (self.num_pages - 1) * self.page_size).astype(np.int32)
        return indptr, indices, last

    def check_pages(self, num_pages_in_cache: int, name: str = "paged_kv_cache") -> None:
        """Raise ``ValueError`` if any used page id is ``>= num_pages_in_cache``."""
        mx = int(self.table.max()) if self.table.size else -1
        if mx >= num_pages_in_cache:
            r, c = np.argwhere(self.table == mx)[0]
            raise ValueError(f"block_tables[{r}, {c}] = {mx} is out of range for {name} with "
                             f"{num_pages_in_cache} pages")


def _check_csr_page_ids(used: np.ndarray) -> None:
    """``ValueError`` naming ``indices[k]`` for a used page id that is negative or past int32
    (checked here, so that the message names the CSR argument, not the padded table that
    :func:`csr_to_padded` builds from it)."""
    bad = np.flatnonzero((used < 0) | (used > INT32_MAX))
    if bad.size:
        k = int(bad[0])
        v = int(used[k])
        if v < 0:
            raise ValueError(f"indices[{k}] = {v} is a negative page id")
        raise ValueError(f"indices[{k}] = {v} does not fit in int32 (the limit is 2^31 - 1)")


def csr_to_padded(indptr, indices, last_page_len, page_size: int):
    """FlashInfer's CSR page table as a padded one: ``(table, seq_lens)``, int32 ``[batch,
    max_pages]`` (``-1`` past each request's pages) and int32 ``[batch]``.  Request ``r`` owns
    ``indices[indptr[r]:indptr[r+1]]`` and fills ``last_page_len[r]`` tokens (``1..page_size``)
    of its last page.  Errors name the argument at fault, or the request whose length would
    not fit int32."""
    page_size = _check_page_size(page_size)
    ip = _as_int_array(indptr, "indptr", 1)
    idx = _as_int_array(indices, "indices", 1)
    lpl = _as_int_array(last_page_len, "last_page_len", 1)
    if all(a.dtype.kind == "i" and a.dtype.isnative for a in (ip, idx, lpl)):
        # a serving loop's call: every check and the fill in one compiled pass; any failure
        # goes to the checked path below, which names the argument at fault
        table, seq, ok = _csr_padded_nb(ip, idx, lpl, page_size)
        if ok:
            return table, seq
    return _csr_to_padded_checked(ip, idx, lpl, page_size)


def _csr_to_padded_checked(ip, idx, lpl, page_size: int):
    """:func:`csr_to_padded` in NumPy, one check at a time (the reference for the compiled
    pass, and the path that names what is wrong): integer host arrays, a checked
    ``page_size``."""
    ip, idx, lpl = (_int64(ip, "indptr"), _int64(idx, "indices"),
                    _int64(lpl, "last_page_len"))
    if ip.shape[0] < 1 or ip[0] != 0:
        raise ValueError("indptr must start with 0")
    if ip.shape[0] == 1:
        raise ValueError("indptr = [0] lists no request: a batch needs at least one")
    npages = np.diff(ip)
    if np.any(npages < 1):
        raise ValueError("indptr must be strictly increasing (every request needs a page)")
    if ip[-1] > idx.shape[0]:
        raise ValueError(f"indptr[-1] = {ip[-1]} exceeds len(indices) = {idx.shape[0]}")
    B = ip.shape[0] - 1
    if lpl.shape[0] != B:
        raise ValueError(f"last_page_len has {lpl.shape[0]} entries, expected {B}")
    if np.any(lpl < 1) or np.any(lpl > page_size):
        raise ValueError(f"last_page_len entries must lie in [1, page_size={page_size}]")
    _check_csr_page_ids(idx[: ip[-1]])
    seq = (npages - 1) * page_size + lpl
    if seq.max() > INT32_MAX:
        bad = int(np.argmax(seq))
        raise ValueError(f"request {bad} holds {int(seq[bad])} tokens; seq_lens must fit in "
                         "int32 (the limit is 2^31 - 1)")
    return _csr_fill(ip, idx, int(npages.max())), seq.astype(np.int32)


@njit(cache=True, nogil=True)
def _csr_padded_nb(ip, idx, lpl, page_size):
    """:func:`csr_to_padded`'s checks and result in one pass over signed integer arrays:
    ``(table, seq_lens, ok)``; where any check fails ``ok`` is False and the arrays are not
    the result."""
    B = max(ip.shape[0] - 1, 0)
    ok = ip.shape[0] >= 2 and ip[0] == 0 and lpl.shape[0] == B and ip[B] <= idx.shape[0]
    width = 0
    for r in range(B if ok else 0):
        n = np.int64(ip[r + 1]) - np.int64(ip[r])
        last = np.int64(lpl[r])
        if n < 1 or last < 1 or last > page_size or (n - 1) * page_size + last > 2147483647:
            ok = False
            break
        width = max(width, n)
    out = np.full((B if ok else 0, width), -1, dtype=np.int32)
    seq = np.empty(B if ok else 0, dtype=np.int32)
    for r in range(B if ok else 0):
        n = ip[r + 1] - ip[r]
        for c in range(n):
            v = idx[ip[r] + c]
            if v < 0 or v > 2147483647:
                return out, seq, False
            out[r, c] = v
        seq[r] = (n - 1) * page_size + lpl[r]
    return out, seq, ok


@njit(cache=True, nogil=True)
def _csr_fill(ip, idx, width):
    """int32 ``[batch, width]``: row ``r`` holds ``idx[ip[r]:ip[r+1]]`` (checked to fit),
    then ``-1``."""
    B = ip.shape[0] - 1
    out = np.full((B, width), -1, dtype=np.int32)
    for r in range(B):
        for c in range(ip[r + 1] - ip[r]):
            out[r, c] = idx[ip[r] + c]
    return out


@njit(cache=True, nogil=True)
def _mask_padding(src, npages):
    """int32 copy of ``src`` with ``-1`` past each row's used pages; also the first used entry
    that is negative or too large for int32 (``(-1, -1)`` when none)."""
    B, W = src.shape
    out = np.empty((B, W), dtype=np.int32)
    bad_r = -1
    bad_c = -1
    for r in range(B):
        k = npages[r]
        for c in range(W):
            if c < k:
                v = src[r, c]
                if (v < 0 or v > 2147483647) and bad_r < 0:
                    bad_r = r
                    bad_c = c
                out[r, c] = v
            else:
                out[r, c] = -1
    return out, bad_r, bad_c


def _check_page_size(page_size) -> int:
    return check_size(page_size, "page_size")


def _check_seq_lens(seq_lens, batch: int) -> np.ndarray:
    if seq_lens is None:
        raise ValueError("seq_lens is required with a padded or list block table")
    sl = _as_int_array(seq_lens, "seq_lens", 1)
    if sl.shape[0] != batch:
        raise ValueError(f"seq_lens has {sl.shape[0]} entries but block_tables has {batch} rows")
    if batch == 0:
        raise ValueError("block_tables is empty: a batch needs at least one request")
    if sl.min() < 1:
        bad = int(np.argmin(sl))
        raise ValueError(f"seq_lens[{bad}] = {int(sl[bad])}; every request needs seq_len >= 1")
    if sl.max() > INT32_MAX:
        bad = int(np.argmax(sl))
        raise ValueError(f"seq_lens[{bad}] = {int(sl[bad])} exceeds the limit 2^31 - 1")
    return sl.astype(np.int32)


MAX_QO_LEN = 16   # query tokens per request (speculative decoding verifies 2-8 drafts)


def check_qo_indptr(qo_indptr, seq_lens: np.ndarray) -> np.ndarray:
    """Validate FlashInfer's ragged query layout against the batch; int32 ``[batch + 1]``.

    ``qo_indptr``: int ``[batch + 1]``, ``qo_indptr[0] == 0``, request ``r`` owning query rows
    ``qo_indptr[r]:qo_indptr[r + 1]``, between 1 and :data:`MAX_QO_LEN` of them.
    ``seq_lens`` (int ``[batch]``, already checked) include the new tokens, so each request
    needs ``seq_len >= q_len`` (its first query token sees ``seq_len - q_len + 1 >= 1`` keys).
    Every error names ``qo_indptr``.
    """
    arr = _to_numpy(qo_indptr, "qo_indptr")
    if arr.dtype == object or arr.dtype == np.bool_ or (
            arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"qo_indptr must be an integer array, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"qo_indptr must be 1-D [batch + 1], got shape {arr.shape}")
    batch = int(seq_lens.shape[0])
    if arr.shape[0] != batch + 1:
        raise ValueError(f"qo_indptr has {arr.shape[0]} entries; the batch of {batch} requests "
                         f"needs batch + 1 = {batch + 1}")
    a = _int64(arr, "qo_indptr")
    if a[0] != 0:
        raise ValueError(f"qo_indptr[0] = {int(a[0])}; it must start at 0")
    qlen = np.diff(a)
    if qlen.size and qlen.min() < 1:
        bad = int(np.argmin(qlen))
        raise ValueError(f"qo_indptr gives request {bad} {int(qlen[bad])} query tokens "
                         f"(qo_indptr must increase: every request has 1.."
                         f"{MAX_QO_LEN} tokens)")
    if qlen.size and qlen.max() > MAX_QO_LEN:
        bad = int(np.argmax(qlen))
        raise ValueError(f"qo_indptr gives request {bad} {int(qlen[bad])} query tokens; the "
                         f"limit is {MAX_QO_LEN}")
    short = np.flatnonzero(qlen > seq_lens)
    if short.size:
        bad = int(short[0])
        raise ValueError(f"qo_indptr gives request {bad} {int(qlen[bad])} query tokens but "
                         f"seq_lens[{bad}] = {int(seq_lens[bad])}: seq_lens include the new "
                         "tokens, so each request needs seq_len >= its query tokens")
    return a.astype(np.int32)


def as_block_table(block_tables, seq_lens, page_size: int) -> BlockTable:
    """Normalise any accepted form (see module docstring) to a :class:`BlockTable`."""
    if isinstance(block_tables, BlockTable):
        return _revalidate(block_tables, seq_lens, page_size)
    if isinstance(block_tables, (list, tuple)):
        return BlockTable.from_lists(block_tables, seq_lens, page_size)
    return BlockTable.from_padded(block_tables, seq_lens, page_size)


def _revalidate(bt: BlockTable, seq_lens, page_size) -> BlockTable:
    """A :class:`BlockTable` built by hand (its fields are public) passes the checks of every
    other form: its table and lengths go through :meth:`BlockTable.from_padded` again, and its
    ``num_pages`` must agree with the lengths."""
    page_size = _check_page_size(page_size)
    if not isinstance(bt.page_size, (int, np.integer)) or isinstance(bt.page_size, bool) \
            or int(bt.page_size) != page_size:
        raise ValueError(f"page_size = {page_size} differs from the BlockTable's "
                         f"{bt.page_size!r}")
    table = _as_int_array(bt.table, "block_tables.table", 2)
    own = _as_int_array(bt.seq_lens, "block_tables.seq_lens", 1)
    if seq_lens is not None:
        sl = _check_seq_lens(seq_lens, own.shape[0])
        if not np.array_equal(sl, own):
            raise ValueError("seq_lens disagrees with the BlockTable's lengths; pass None")
    out = BlockTable.from_padded(table, own, page_size)
    npages = _as_int_array(bt.num_pages, "block_tables.num_pages", 1)
    if npages.shape != out.num_pages.shape or not np.array_equal(npages, out.num_pages):
        raise ValueError("block_tables.num_pages disagrees with ceil(seq_lens / page_size); "
                         "build the BlockTable with from_padded, from_lists or from_csr")
    return out


def check_size(v, name: str, limit: int = INT32_MAX) -> int:
    """A size argument as a Python int (NumPy integer scalars of any width converted, so no
    later arithmetic overflows in a narrow type); ``TypeError``/``ValueError`` naming ``name``
    unless it is an int in ``[1, limit]``."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    v = int(v)
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    if v > limit:
        raise ValueError(f"{name} = {v} exceeds the limit {limit}")
    return v


def check_heads(num_qo_heads, num_kv_heads, head_dim) -> tuple:
    """Validate head counts and head dimension (errors name the argument); return them as
    Python ints ``(num_qo_heads, num_kv_heads, head_dim)``."""
    hq = check_size(num_qo_heads, "num_qo_heads", 65536)
    hk = check_size(num_kv_heads, "num_kv_heads", 65536)
    d = check_size(head_dim, "head_dim", 65536)
    if hq % hk:
        raise ValueError(f"num_qo_heads = {hq} is not a multiple of num_kv_heads = {hk}")
    return hq, hk, d


def byte_extent(ptr: int, shape, strides, itemsize: int) -> tuple:
    """``(lo, hi)``: the half-open byte range an array of ``shape`` with element ``strides``
    (any signs) starting at address ``ptr`` touches; ``(ptr, ptr)`` when it is empty."""
    if any(int(s) == 0 for s in shape):
        return int(ptr), int(ptr)
    lo = hi = 0
    for n, st in zip(shape, strides):
        span = (int(n) - 1) * int(st) * itemsize
        if span < 0:
            lo += span
        else:
            hi += span
    return int(ptr) + lo, int(ptr) + hi + itemsize


def refuse_self_overlap(name: str, shape, strides) -> None:
    """``ValueError`` naming ``name`` when an output of ``shape`` with element ``strides`` may
    map two of its indices to one element (a zero stride, overlapping rows): its results would
    overwrite each other.  With its dimensions of extent > 1 ordered by stride, each stride
    must span the ones below it; the layouts of slices, transposes and broadcasts pass or fail
    exactly, and an interleaving of two dimensions that never collides is refused too, which
    no caller's buffer has."""
    dims = sorted((abs(int(st)), int(n)) for n, st in zip(shape, strides) if int(n) > 1)
    span = 1
    for st, n in dims:
        if st < span:
            raise ValueError(f"{name} has strides {tuple(int(x) for x in strides)} (elements) "
                             f"for shape {tuple(int(x) for x in shape)}: some of its elements "
                             "share memory, so the results would overwrite each other")
        span = st * n


def refuse_overlap(outputs: dict, others: dict) -> None:
    """``ValueError`` naming the pair when an output's byte range (``{name: (lo, hi)}``)
    overlaps another output's or an input's (``others``).  Ranges, not elements: two strided
    views that interleave without sharing an element are refused too (rare for outputs)."""
    names = list(outputs)
    for i, a in enumerate(names):
        alo, ahi = outputs[a]
        cands = [(b, outputs[b]) for b in names[i + 1:]] + list(others.items())
        for b, (blo, bhi) in cands:
            if alo < bhi and blo < ahi:
                raise ValueError(f"{a} overlaps {b} in memory: run() writes {a}, so it must not "
                                 f"share storage with {b}")
