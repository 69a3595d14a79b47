"""PrefixForest against brute-force token comparison."""
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pat_core.forest import PrefixForest
from pat_core.inputs import BlockTable
from strategies import prefix_batches


def brute_lcp(bt: BlockTable, a: int, b: int) -> int:
    """Tokens shared by requests a and b, token by token (the slow, obvious definition)."""
    n = 0
    ps = bt.page_size
    while n < min(bt.seq_lens[a], bt.seq_lens[b]) and \
            bt.table[a, n // ps] == bt.table[b, n // ps]:
        n += 1
    return n


def lca(f: PrefixForest, u: int, v: int) -> int:
    anc = set()
    while u >= 0:
        anc.add(u)
        u = int(f.parent[u])
    while v not in anc:
        v = int(f.parent[v])
    return v


def brute_unique_tokens(bt: BlockTable) -> int:
    seen = set()
    ps = bt.page_size
    for r in range(bt.batch_size):
        for t in range(int(bt.seq_lens[r])):
            seen.add((t, tuple(bt.table[r, : t // ps + 1].tolist())))
    return len(seen)


def check_forest(bt: BlockTable):
    f = PrefixForest(bt)
    B = bt.batch_size
    # every request ends at the node holding its last token, and nodes tile [0, len)
    for r in range(B):
        u = int(f.req_node[r])
        assert f.end[u] == bt.seq_lens[r]
        pos = f.end[u]
        while u > 0:
            assert f.end[u] == pos and f.start[u] < f.end[u]
            pos = f.start[u]
            assert r in f.node_requests(u)
            u = int(f.parent[u])
        assert pos == 0
    # the LCA of two requests ends exactly where their tokens stop agreeing
    for a, b in itertools.combinations(range(B), 2):
        w = lca(f, int(f.req_node[a]), int(f.req_node[b]))
        assert f.end[w] == brute_lcp(bt, a, b), (a, b)
    assert f.unique_tokens() == brute_unique_tokens(bt)
    # subtree ranges nest and children are ordered
    for u in range(1, f.num_nodes):
        p = int(f.parent[u])
        assert f.lo[p] <= f.lo[u] < f.hi[u] <= f.hi[p]
        assert f.start[u] == f.end[p]
    return f


@given(prefix_batches(max_requests=12, page_sizes=(1, 2, 3, 16)))
def test_forest_matches_brute_force(b):
    bt = BlockTable.from_padded(b.block_tables, b.seq_lens, b.page_size)
    check_forest(bt)


def test_request_ending_inside_shared_page():
    # request 1 covers 1 token of page 2; request 0 covers 8 of it
    bt = BlockTable.from_lists([[7, 8, 2], [7, 8, 2], [7, 9]], [28, 21, 20], 10)
    f = check_forest(bt)
    assert f.end[f.req_node[1]] == 21
    assert f.unique_tokens() == 28 + 10


def test_identical_requests_share_one_node():
    bt = BlockTable.from_lists([[1, 2], [1, 2], [1, 2]], [20, 20, 20], 16)
    f = check_forest(bt)
    assert len(set(f.req_node.tolist())) == 1
    assert f.num_nodes == 2


def test_several_roots_and_page_size_one():
    bt = BlockTable.from_lists([[1, 2, 3], [1, 2, 4], [5], [6, 7]], [3, 3, 1, 2], 1)
    f = check_forest(bt)
    assert len(f.roots()) == 3


def tree_heuristic_reference(f: PrefixForest, mode: int, rpre, max_rows: int, max_req: int,
                             kv_tok: int, row_slot: int):
    """TreeHeuristic in plain Python lists (the walk of ``packers._tree_heuristic``, one node
    at a time): ``(req_indptr, reqs, kv_start, kv_end, level)``."""
    def pad(rows):
        if rows <= 0:
            return 0
        full = rows // max_rows * max_rows
        p = 16
        while p < rows - full:
            p *= 2
        return full + (p if rows > full else 0)
    ind, reqs, ks, ke, lv = [0], [], [], [], []
    ci, ch = f.child_indptr, f.children
    stack = [(int(c), int(f.start[c])) for c in ch[ci[0]:ci[1]]]
    while stack:
        u, acc = stack.pop()
        L = int(f.end[u]) - acc
        rem, pos = [], int(f.lo[u])
        rows_u = int(rpre[f.hi[u]] - rpre[f.lo[u]])
        for c in ch[ci[u]:ci[u + 1]]:
            rem += list(range(pos, int(f.lo[c])))
            rows_c = int(rpre[f.hi[c]] - rpre[f.lo[c]])
            if mode == 0:
                merge = rows_c * row_slot > L * kv_tok * (-(-rows_c // max_rows))
            elif mode == 1:
                merge = pad(rows_u - rows_c) + pad(rows_c) < pad(rows_u)
            else:
                merge = mode == 3
            if merge:
                stack.append((int(c), acc))
                rows_u -= rows_c
            else:
                stack.append((int(c), int(f.start[c])))
                rem += list(range(int(f.lo[c]), int(f.hi[c])))
            pos = int(f.hi[c])
        rem += list(range(pos, int(f.hi[u])))
        q0 = 0
        while q0 < len(rem):
            q1, used = q0 + 1, int(rpre[rem[q0] + 1] - rpre[rem[q0]])
            while q1 < len(rem) and q1 - q0 < max_req:
                r_rows = int(rpre[rem[q1] + 1] - rpre[rem[q1]])
                if used + r_rows > max_rows:
                    break
                used += r_rows
                q1 += 1
            reqs += [int(f.order[q]) for q in rem[q0:q1]]
            ind.append(len(reqs))
            ks.append(acc)
            ke.append(int(f.end[u]))
            lv.append(int(f.level[u]))
            q0 = q1
    return ind, reqs, ks, ke, lv


@settings(max_examples=80, deadline=None)
@given(b=prefix_batches(), mode=st.sampled_from([0, 1, 2, 3]),
       group=st.sampled_from([1, 2, 4, 8]), caps=st.tuples(st.integers(0, 40),
                                                          st.integers(0, 80)))
def test_tree_walk_equals_the_reference_and_sizes_short_buffers(b, mode, group, caps):
    """The compiled packing walk packs as the plain-Python walk does, and a walk into buffers
    too short for it counts what it needs (the caller's second walk at those sizes packs the
    same)."""
    from pat_core.packers import _tree_heuristic, _tree_walk
    f = PrefixForest(BlockTable.from_padded(b.block_tables, b.seq_lens, b.page_size))
    B = f.order.shape[0]
    max_rows = 16 * group
    rpre = np.arange(B + 1, dtype=np.int64) * group
    args = (f.start, f.end, f.lo, f.hi, f.child_indptr, f.children, f.order, f.level)
    consts = (mode, rpre, max_rows, max_rows // group, 512, 1288)
    want = tree_heuristic_reference(f, mode, rpre, max_rows, max_rows // group, 512, 1288)
    got = _tree_heuristic(*args, f.req_node, *consts)
    for g, w in zip(got[:5], want):
        assert g.tolist() == list(w)
    n_p, n_r, *_ = _tree_walk(*args, *consts, *caps)
    assert (n_p, n_r) == (len(want[2]), len(want[1]))
    n_p, n_r, p_ind, p_s, p_e, p_lv, p_r = _tree_walk(*args, *consts, n_p, n_r)
    assert p_ind[:n_p + 1].tolist() == want[0] and p_r[:n_r].tolist() == want[1]
    assert p_s[:n_p].tolist() == want[2] and p_e[:n_p].tolist() == want[3]
