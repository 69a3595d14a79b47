"""pat inside Hugging Face transformers' continuous batching (pat_core.integrations.transformers).

The read-index conversion and the version check need NumPy only and always run.  The end-to-end
tests build tiny random-weight Llama models from their config objects (no downloads) and
compare ``generate_batch`` greedy tokens with pat against the engine's own ``paged|sdpa`` on
the CPU in float32; they skip when torch or transformers (the ``.[transformers]`` extra, not
installed by CI) is missing.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pat_core.integrations.transformers import (SUPPORTED_TRANSFORMERS,
                                                check_transformers_version, query_lengths,
                                                read_index_to_csr)
from strategies import prefix_batches

HAVE_HF = (importlib.util.find_spec("torch") is not None
           and importlib.util.find_spec("transformers") is not None)
needs_hf = pytest.mark.skipif(not HAVE_HF, reason="torch and transformers not installed "
                              "(pip install -e '.[transformers]'); CI does not install them")


def engine_read_index(block_tables, seq_lens, page_size):
    """Read indices as the engine's full-attention allocator lists them: each request's
    positions in order, position p at row page[p // page_size] * page_size + p % page_size."""
    rows = []
    for bt, n in zip(block_tables, seq_lens):
        p = np.arange(int(n))
        rows.append(np.asarray(bt)[p // page_size].astype(np.int64) * page_size + p % page_size)
    return np.concatenate(rows)


# ---------------------------------------------------------------- NumPy only
@settings(deadline=None)
@given(b=prefix_batches(max_requests=12), pad=st.integers(0, 40))
def test_read_index_to_csr_round_trip(b, pad):
    """The CSR form lists each request's pages of the block table, in order, and its last
    page's tokens; padding entries past the last request are ignored."""
    ri = engine_read_index(b.block_tables, b.seq_lens, b.page_size)
    ri = np.concatenate([ri, np.full(pad, 7, dtype=np.int64)])
    ck = np.concatenate([[0], np.cumsum(b.seq_lens)])
    indptr, indices, last = read_index_to_csr(ri, ck, b.page_size)
    assert indptr.dtype == indices.dtype == last.dtype == np.int32
    for r, n in enumerate(b.seq_lens):
        npages = -(-int(n) // b.page_size)
        assert indptr[r + 1] - indptr[r] == npages
        assert np.array_equal(indices[indptr[r]:indptr[r + 1]], b.block_tables[r, :npages])
        assert last[r] == (int(n) - 1) % b.page_size + 1


@settings(deadline=None)
@given(b=prefix_batches(max_requests=8), data=st.data())
def test_read_index_to_csr_refuses_rows_out_of_page_order(b, data):
    """A row moved inside or out of its page is refused, naming read_index."""
    ri = engine_read_index(b.block_tables, b.seq_lens, b.page_size)
    ck = np.concatenate([[0], np.cumsum(b.seq_lens)])
    i = data.draw(st.integers(0, ri.size - 1))
    delta = data.draw(st.sampled_from([1, -1, b.page_size + 1, 3 * b.page_size]))
    bad = ri.copy()
    bad[i] += delta
    pos = i - ck[np.searchsorted(ck, i, side="right") - 1]
    if pos % b.page_size == 0 and bad[i] % b.page_size == 0 and bad[i] >= 0:
        # a page's first row moved to another page's first row: a valid table of other pages,
        # unless the page continues (its next rows still name the old page)
        n_req = int(b.seq_lens[np.searchsorted(ck, i, side="right") - 1])
        if pos + 1 >= n_req or b.page_size == 1:     # a page of that one row
            return
    with pytest.raises(ValueError, match="read_index"):
        read_index_to_csr(bad, ck, b.page_size)


def test_read_index_to_csr_argument_errors():
    with pytest.raises(ValueError, match="page_size"):
        read_index_to_csr(np.arange(4), [0, 4], 0)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        read_index_to_csr(np.arange(4), [1, 4], 2)
    with pytest.raises(ValueError, match="cu_seq_lens_k"):
        read_index_to_csr(np.arange(4), [0, 2, 2, 4], 2)
    with pytest.raises(ValueError, match="read_index has 3"):
        read_index_to_csr(np.arange(3), [0, 4], 2)
    # each argument is named; floats are not truncated, ints past int64 do not overflow
    for bad in ("a", None, 16.5, 2**70):
        with pytest.raises((TypeError, ValueError), match="page_size"):
            read_index_to_csr(np.arange(4), [0, 4], bad)
    for bad in ([0, 2.5, 4], [0, 2**70], ["a"]):
        with pytest.raises(TypeError, match="cu_seq_lens_k"):
            read_index_to_csr(np.arange(4), bad, 2)
    for bad in (np.arange(4) + 0.5, [2**70], np.arange(4, dtype=np.uint64) + np.uint64(2**63)):
        with pytest.raises((TypeError, ValueError), match="read_index"):
            read_index_to_csr(bad, [0, 1], 1)


def test_query_lengths_drops_padding_slots_only():
    assert query_lengths([0, 1, 3, 4, 4, 4]).tolist() == [1, 2, 1]
    assert query_lengths([0]).tolist() == []
    with pytest.raises(ValueError, match="zero-length"):
        query_lengths([0, 1, 1, 2])
    with pytest.raises(ValueError, match="nondecreasing"):
        query_lengths([0, 2, 1])
    for bad in ([0, 1.5], [0, 2**70], ["x"], None):
        with pytest.raises(TypeError, match="cu_seq_lens_q"):
            query_lengths(bad)


def test_version_check():
    check_transformers_version("5.17.0")
    check_transformers_version("5.17.3.dev0")
    for v in ("5.16.2", "5.18.0", "4.57.1"):
        with pytest.raises(RuntimeError, match="5.17"):
            check_transformers_version(v)
    assert SUPPORTED_TRANSFORMERS == ">=5.17,<5.18"


# ---------------------------------------------------------------- end to end (torch, transformers)
def tiny_llama(num_heads, num_kv_heads, layers=2, head_dim=16, seed=0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=num_heads * head_dim, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=num_heads,
                      num_key_value_heads=num_kv_heads, head_dim=head_dim,
                      max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).to(torch.float32).eval()


def generate(model, impl, prompts, new_tokens, *, block_size=16, max_batch_tokens=64,
             num_return_sequences=None, graphs=False, **cb_options):
    from transformers import ContinuousBatchingConfig, GenerationConfig
    model.set_attn_implementation(impl)
    # several samples need do_sample; top_k=1 keeps them greedy (deterministic, comparable)
    sample = {"do_sample": False} if num_return_sequences is None else \
        {"do_sample": True, "top_k": 1}
    gc = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=-1,
                          pad_token_id=0, num_return_sequences=num_return_sequences, **sample)
    cb = ContinuousBatchingConfig(block_size=block_size, num_blocks=128, allow_block_sharing=True,
                                  max_batch_tokens=max_batch_tokens, use_cuda_graph=graphs,
                                  use_async_batching=False, **cb_options)
    out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb,
                               progress_bar=False)
    return {k: list(v.generated_tokens) for k, v in out.items()}


@pytest.fixture
def pat_impl():
    from pat_core.integrations.transformers import register_pat
    return register_pat("paged|pat_test", strict=True)


@needs_hf
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_generate_batch_matches_engine_attention(pat_impl, heads):
    """Greedy tokens with pat equal the engine's paged|sdpa for 32 new tokens per request on a
    batch with a shared system prompt and block sharing on; pat plans once per decode step and
    its plans read shared pages once (fewer KV tokens than the requests attend to)."""
    layers = 3
    model = tiny_llama(*heads, layers=layers)
    rng = np.random.default_rng(1)
    system = rng.integers(3, 250, 40).tolist()          # 2.5 blocks of 16, shared
    # short suffixes: requests admitted after the first one find the system prompt's blocks
    # and bring fewer than 16 new tokens on top of a cache (multi-token pat steps)
    prompts = [system + rng.integers(3, 250, int(n)).tolist() for n in (3, 5, 9, 2, 12)]
    want = generate(model, "paged|sdpa", prompts, 32)
    got = generate(model, pat_impl.name, prompts, 32)
    assert got == want
    assert all(len(t) == 32 for t in got.values())
    s = pat_impl.stats
    assert s["pat_steps"] >= 31                          # every decode step ran pat
    assert s["plans"] == s["pat_steps"]                  # one plan per step, not per layer
    assert s["pat_layer_calls"] == layers * s["pat_steps"]
    assert s["fallback_layer_calls"] == layers * (s["steps"] - s["pat_steps"])
    assert s["multi_token_steps"] >= 1
    assert s["plan_kv_tokens"] < s["request_kv_tokens"]  # pat saw the shared pages
    assert 0 < s["step_host_s"] < s["layer_host_s"]    # planning is inside the layer calls
    assert 0 < s["layer_cpu_s"] <= s["layer_host_s"] * 1.05   # CPU time: at most the wall's
    last = pat_impl.last_plan_stats                      # the last step's plan, read now
    assert last["num_ctas"] >= 1 and 0 < last["kv_tokens"] <= s["plan_kv_tokens"]
    assert sum(last["tiles"].values()) == last["num_ctas"]


@needs_hf
def test_plan_step_is_the_seam_for_another_kernel():
    """A subclass overriding plan_step replaces the kernel for every pat step: it is called
    once per step with the step's CSR page table, its runner computes every layer of the step,
    and a ValueError from it makes the step fall back with the subclass's kernel name.  Here
    the runner is a CPU wrapper planned from the same arrays, so tokens equal paged|sdpa's."""
    from transformers import AttentionInterface
    from pat_core import PrefixAttentionWrapper
    from pat_core.integrations.transformers import PatPagedAttention

    class Counting:
        def __init__(self, w):
            self.w, self.calls = w, 0

        def run(self, q, kv, out):          # the seam's runner contract: out given
            self.calls += 1
            return self.w.run(q, kv, out=out)

    class Other(PatPagedAttention):
        kernel = "other kernel"

        def __init__(self, name):
            super().__init__(name)
            self.runners, self.refuse_multi = [], True

        def plan_step(self, indptr, indices, last, qo_indptr, query, key_states, scaling,
                      cache):
            assert indptr.dtype == indices.dtype == last.dtype == np.int32
            assert indptr.shape == (last.shape[0] + 1,) and indptr[-1] == indices.shape[0]
            if qo_indptr is not None and self.refuse_multi:
                raise ValueError("one token per request only")
            w = PrefixAttentionWrapper(backend="cpu")
            w.plan_csr(indptr, indices, last, int(query.shape[1]), int(key_states.shape[1]),
                       int(query.shape[3]), int(cache.block_size), sm_scale=scaling,
                       kv_data_type=cache.key_cache[0].dtype, q_data_type=query.dtype,
                       qo_indptr=qo_indptr)
            self.runners.append(Counting(w))
            return self.runners[-1]

    layers = 2
    model = tiny_llama(8, 2, layers=layers)
    fn = Other("paged|other_test")
    AttentionInterface.register(fn.name, fn)
    rng = np.random.default_rng(2)
    system = rng.integers(3, 250, 40).tolist()
    prompts = [system + rng.integers(3, 250, int(n)).tolist() for n in (3, 5, 9, 2, 12)]
    want = generate(model, "paged|sdpa", prompts, 16)
    assert generate(model, fn.name, prompts, 16) == want
    s = fn.stats
    assert len(fn.runners) == s["plans"] == s["pat_steps"] >= 15
    assert all(r.calls == layers for r in fn.runners)
    assert s["pat_layer_calls"] == layers * s["pat_steps"]
    # the multi-token step (requests admitted onto the cached system prompt) was refused by
    # the subclass and fell back, its reason naming the kernel
    assert s["multi_token_steps"] == 0
    assert fn.fallback_reasons.get("other kernel refused the step (ValueError: one token per "
                                   "request only)") == 1
    assert s["fallback_layer_calls"] == layers * (s["steps"] - s["pat_steps"])


@needs_hf
def test_parallel_samples_share_the_prompt(pat_impl):
    """num_return_sequences forks one prompt's cache (its full blocks shared between the
    samples); pat's greedy tokens equal the engine's.  (transformers 5.17's generate_batch runs
    the forked samples but returns the first sample of each prompt only; the steps pat planned
    show all six.)"""
    model = tiny_llama(8, 2, layers=2)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 250, 37).tolist(), rng.integers(3, 250, 21).tolist()]
    want = generate(model, "paged|sdpa", prompts, 32, num_return_sequences=3)
    got = generate(model, pat_impl.name, prompts, 32, num_return_sequences=3)
    assert len(got) == 2 and got == want
    s = pat_impl.stats
    assert s["max_requests"] == 6
    assert s["plans"] == s["pat_steps"] >= 31
    assert s["plan_kv_tokens"] < s["request_kv_tokens"]


def layer_differences(model, prompts, name, new_tokens=8):
    """Generate with an implementation that runs pat and, on pat's steps, the engine's
    paged|sdpa on the same inputs; returns (the registered PatPagedAttention, the largest
    absolute difference of the real rows per pat layer call)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from pat_core.integrations.transformers import register_pat
    pat = register_pat(name, strict=True)
    diffs = []

    def both(module, query, key, value, attention_mask, **kw):
        out_pat, _ = pat(module, query, key, value, attention_mask, **kw)   # writes the new K/V
        step = pat._step
        if step is not None and step.use_pat:
            # the engine's attention on the same inputs (its update() writes the same rows)
            mask = pat._fallback_mask(step, module, query, kw)
            ref, _ = ALL_ATTENTION_FUNCTIONS["paged|sdpa"](module, query, key, value, mask,
                                                           **kw)
            n = step.num_tokens
            diffs.append(float((out_pat[0, :n].float() - ref[0, :n].float()).abs().max()))
        return out_pat, None

    AttentionInterface.register(name + "_both", both)
    generate(model, name + "_both", prompts, new_tokens)
    return pat, diffs


def shared_prompts(seed, system_len=33, suffixes=(4, 1, 7)):
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 250, system_len).tolist()
    return [system + rng.integers(3, 250, int(n)).tolist() for n in suffixes]


@needs_hf
def test_layer_output_matches_engine_attention():
    """On every pat step, every layer's pat output equals the engine's paged|sdpa output on the
    same inputs (float32, to rounding)."""
    model = tiny_llama(8, 2, layers=2)
    pat, diffs = layer_differences(model, shared_prompts(3), "paged|pat_cmp")
    assert pat.stats["pat_steps"] >= 7 and len(diffs) == 2 * pat.stats["pat_steps"]
    assert max(diffs) < 1e-5, max(diffs)


@needs_hf
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_cpu_steps(dtype):
    """16-bit CPU models: every pat layer call is within the dtype's rounding of paged|sdpa
    (both round their output to it; bfloat16's half unit in the last place at 1 is 2^-9), and
    float16 greedy tokens equal the engine's for 32 tokens.  (bfloat16 tokens may part once a
    rounding flips an argmax; docs/engines.md records where.)"""
    import torch
    model = tiny_llama(8, 2, layers=3).to(getattr(torch, dtype))
    pat, diffs = layer_differences(model, shared_prompts(3), "paged|pat_cpu_" + dtype)
    assert pat.stats["pat_steps"] >= 7 and len(diffs) == 3 * pat.stats["pat_steps"]
    assert max(diffs) <= (2.0 ** -10 if dtype == "float16" else 2.0 ** -8), max(diffs)
    if dtype == "float16":
        from pat_core.integrations.transformers import register_pat
        impl = register_pat("paged|pat_cpu_tokens", strict=True)
        prompts = shared_prompts(5, suffixes=(3, 5, 9, 2, 12))
        assert generate(model, impl.name, prompts, 32) == generate(model, "paged|sdpa",
                                                                   prompts, 32)


@needs_hf
def test_sliding_window_model_falls_back_to_the_engine():
    """A sliding-window model (Mistral config, window 24 < the prompts) is not pat's: every
    step runs paged|sdpa with the sliding mask the integration builds, and the tokens equal
    the engine's own."""
    import torch
    from transformers import MistralConfig, MistralForCausalLM
    from pat_core.integrations.transformers import register_pat
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=1024, sliding_window=24)
    model = MistralForCausalLM(cfg).to(torch.float32).eval()
    pat = register_pat("paged|pat_sliding")
    prompts = shared_prompts(6, suffixes=(3, 8))
    assert generate(model, pat.name, prompts, 16) == generate(model, "paged|sdpa", prompts, 16)
    assert pat.stats["pat_steps"] == 0 and pat.stats["steps"] >= 16
    assert pat.stats["fallback_layer_calls"] == 2 * pat.stats["steps"]
    assert list(pat.fallback_reasons) == ["cache with sliding-window or several layer groups"]


@needs_hf
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_layer_output_and_tokens(dtype):
    """CUDA tensors run pat's kernels (backend "cuda"): every pat layer call is close to the
    engine's paged|sdpa (16-bit rounding), and float16 greedy tokens equal the engine's."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    tdt = getattr(torch, dtype)
    model = tiny_llama(8, 2, layers=2, head_dim=64).to("cuda", tdt)
    pat, diffs = layer_differences(model, shared_prompts(4), "paged|pat_gpu_" + dtype, 16)
    assert set(pat._wrappers) == {"cuda"}
    assert pat.stats["pat_steps"] >= 15 and len(diffs) == 2 * pat.stats["pat_steps"]
    assert max(diffs) < (4e-3 if dtype == "float16" else 3e-2), max(diffs)   # 1-2 ulp near 1-2
    if dtype == "float16":
        from pat_core.integrations.transformers import register_pat
        impl = register_pat("paged|pat_gpu_tokens", strict=True)
        prompts = shared_prompts(5, suffixes=(3, 5, 9, 2))
        assert generate(model, impl.name, prompts, 32) == generate(model, "paged|sdpa",
                                                                   prompts, 32)


@needs_hf
@pytest.mark.gpu
def test_gpu_engine_cuda_graphs():
    """With the engine's CUDA graphs on, pat's decode steps run from the engine's graphs (the
    hook plans each step before the replay; layer calls happen only while a graph is
    captured), the prefill steps eagerly, and the float16 greedy tokens equal the engine's
    paged|sdpa without graphs and pat's without graphs."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    from pat_core.integrations.transformers import register_pat
    model = tiny_llama(8, 2, layers=2, head_dim=64).to("cuda", torch.float16)
    prompts = shared_prompts(6, suffixes=(3, 5, 9, 2, 6))
    impl = register_pat("paged|pat_gpu_graphs", strict=True)
    want = generate(model, "paged|sdpa", prompts, 32)
    # the graph run first, on a seam no eager run has used: its shapes come from the graph
    # run's own prefill steps
    # query rows padded to multiples of 4: the engine captures a graph per padded size, and
    # the steps' batch sizes (3 to 5 requests) go up and down between them; the KV read padded
    # to 16 tokens, so that its padded size changes every few steps (the engine's own key
    # would capture again each time; pat's graph steps are keyed by query rows alone)
    assert generate(model, impl.name, prompts, 32, graphs=True, q_padding_interval_size=4,
                    kv_padding_interval_size=16) == want
    s = dict(impl.stats)
    assert generate(model, impl.name, prompts, 32) == want
    # one-token steps from graphs; the few steps where a late request brings several tokens
    # on top of the shared prompt's cache run pat eagerly
    assert s["graph_steps"] >= 24 and s["multi_token_steps"] >= 1, s
    assert s["graph_steps"] + s["multi_token_steps"] == s["pat_steps"], s
    # a replay calls no layer: only a graph's capture does (2 layers, called twice: the
    # engine's warm-up run and the capture), once per padded size, so far fewer layer calls
    # than the 2 per step of eager steps
    captured = s["pat_layer_calls"] - 2 * s["multi_token_steps"]
    assert 0 < captured <= s["graph_steps"], s
    # exactly two graphs: one per padded row count (4 and 8), whatever the KV read
    assert captured == 2 * 2 * 2, s
    assert s["steps"] > s["pat_steps"]          # the prefill steps, run eagerly
    assert s["fallback_layer_calls"] >= 2 * (s["steps"] - s["pat_steps"])


@needs_hf
def test_engine_hook_refuses_async_batching_and_runs_fallback_steps_eagerly():
    """The engine hook: async batching with CUDA graphs is refused by name; a step the seam
    runs eagerly makes the engine's forward-function choice say "no graph" while it runs; the
    engine's compute_batch is routed to the seam of the model's implementation."""
    import types
    from transformers.generation.continuous_batching.input_outputs import \
        ContinuousBatchingAsyncIOs
    from transformers.generation.continuous_batching.model_runner import ModelRunner
    from pat_core.integrations.transformers import register_pat
    pat = register_pat("paged|pat_hook")
    runner = types.SimpleNamespace(
        inputs_and_outputs=object.__new__(ContinuousBatchingAsyncIOs))
    with pytest.raises(RuntimeError, match="use_async_batching=False"):
        pat.engine_step(runner, None, {}, lambda *a: None)
    r = object.__new__(ModelRunner)
    r._compiled_varlen, r._compiled_decode = None, None
    r.use_cuda_graph_varlen, r.use_cuda_graph_decode = True, True
    assert r._get_forward_fn(use_block_table=False)[1] is True
    r._pat_eager = True
    assert r._get_forward_fn(use_block_table=False)[1] is False
    r._pat_eager = False

    # a step the seam does not take (no cache to read: a prefill) runs the engine's compute
    # with the flag up, so its forward-function choice says "no graph"; the flag is down after
    import torch
    r.inputs_and_outputs = types.SimpleNamespace(use_block_table=False, compute_stream=None)
    cache = types.SimpleNamespace(num_groups=1, sliding_windows={0: 1})
    batch = {"read_index": [torch.zeros(0, dtype=torch.int64)], "write_index": [None],
             "cu_seq_lens_q": torch.tensor([0, 5], dtype=torch.int32),
             "cu_seq_lens_k": torch.tensor([0, 5], dtype=torch.int32),
             "input_ids": torch.zeros(1, 5, dtype=torch.int64), "cache": cache}
    seen = []

    def compute(runner, model, batch_data):
        seen.append(runner._get_forward_fn(use_block_table=False)[1])
        return "computed"
    assert pat.engine_step(r, None, batch, compute) == "computed"
    assert seen == [False] and r._pat_eager is False
    assert pat.stats["steps"] == 1 and pat.stats["pat_steps"] == pat.stats["graph_steps"] == 0
    assert pat.fallback_reasons == {"no cache read (prefill)": 1}
    # the engine's compute_batch goes through the hook for a model using a registered seam
    routed = []
    pat.engine_step = lambda runner, model, batch_data, compute: routed.append(runner)
    model = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=pat.name))
    ModelRunner.compute_batch(r, model, batch)
    assert routed == [r]


@needs_hf
def test_a_step_the_hook_decided_records_the_layer_shape():
    """The layer shape graph steps are planned with is read from the layer calls of the steps
    before them, also of steps the engine hook decided (with graphs on, every step goes
    through the hook: the prefill steps before the first graph step too).  Without it a graph
    run's decode steps were refused until some eager run had called a layer."""
    import types
    import torch
    from transformers import AttentionInterface
    from pat_core.integrations.transformers import register_pat
    AttentionInterface.register(
        "paged|shape_fallback",
        lambda module, q, k, v, mask, dropout=0.0, scaling=None, **kw: (q.transpose(1, 2), None))
    pat = register_pat("paged|pat_shape", fallback="paged|shape_fallback")
    runner = types.SimpleNamespace(
        inputs_and_outputs=types.SimpleNamespace(use_block_table=False, compute_stream=None),
        _pat_eager=False)
    cache = types.SimpleNamespace(num_groups=1, sliding_windows={0: 1})
    batch = {"read_index": [torch.zeros(0, dtype=torch.int64)], "write_index": [None],
             "cu_seq_lens_q": torch.tensor([0, 5], dtype=torch.int32),
             "cu_seq_lens_k": torch.tensor([0, 5], dtype=torch.int32),
             "input_ids": torch.zeros(1, 5, dtype=torch.int64), "cache": cache}
    q = torch.zeros(1, 4, 5, 16, dtype=torch.float16)
    k = torch.zeros(1, 2, 5, 16, dtype=torch.float16)
    layer = types.SimpleNamespace(layer_idx=0)

    def compute(r, model, bd):
        return pat(layer, q, k, k, None, scaling=0.25, **bd)
    assert pat._shape is None
    pat.engine_step(runner, None, batch, compute)
    assert pat.fallback_reasons == {"no cache read (prefill)": 1}
    assert pat._shape == (4, 2, 16, 0.25, torch.float16, q.device)


@needs_hf
def test_graph_steps_key_the_engines_graphs_by_query_rows_alone():
    """A graph step pat (or another runner through plan_graph_step) takes is looked up and
    stored under a key of its padded query rows, not the engine's (rows, padded KV read, ...):
    its graph reads no read index, and the engine's key made a new capture every KV padding
    interval.  Outside such a step the engine's own key is back."""
    import types
    import torch
    from pat_core.integrations.transformers import GRAPH_KEY_TAG, register_pat

    class IO:
        use_block_table = False
        num_q_tokens = 4

        def _get_graph_key(self):
            return (self.num_q_tokens, 32)
    io = IO()
    runner = types.SimpleNamespace(inputs_and_outputs=io, _pat_eager=False)
    pat = register_pat("paged|pat_graph_key")
    graph_runner = types.SimpleNamespace(use_cuda_graph=True)
    pat.plan_graph_step = lambda *a: graph_runner
    cache = types.SimpleNamespace(num_groups=1, sliding_windows={0: 1}, block_size=16)
    batch = {"read_index": [torch.arange(32, dtype=torch.int64)], "write_index": [None],
             "cu_seq_lens_q": torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32),
             "cu_seq_lens_k": torch.tensor([0, 16, 32, 32, 32], dtype=torch.int32),
             "input_ids": torch.zeros(1, 4, dtype=torch.int64), "cache": cache}
    keys = []

    def compute(r, model, bd):
        keys.append(r.inputs_and_outputs._get_graph_key())
    pat.engine_step(runner, None, batch, compute)
    assert pat.stats["graph_steps"] == 1, pat.fallback_reasons
    assert keys == [(GRAPH_KEY_TAG, 4)]
    assert io._get_graph_key() == (4, 32)            # the engine's own key outside the step
    pat.plan_graph_step = lambda *a: types.SimpleNamespace(use_cuda_graph=False)
    pat.engine_step(runner, None, batch, compute)   # an eager step: the engine's key
    assert keys[-1] == (4, 32)


@needs_hf
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2], ids=["graph-safe", "multi-token"])
def test_gpu_graph_step_plans_on_the_compute_stream(tokens):
    """plan_graph_step plans on the engine's compute stream: a step planned while the default
    stream is held up by a long sleep and run on a non-blocking compute stream (the one-token
    step on the graph-safe wrapper with its full-size buffers, the multi-token step on pat's
    plain wrapper, as the engine runs it eagerly) equals the same step on an idle GPU.  Planned
    on the default stream, a new state's zero-fill and copy would land behind the sleep, after
    the kernels that read them (here: counters left at -1 in reused memory)."""
    import types
    import torch
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    import cupy as cp
    from pat_core.inputs import BlockTable
    from pat_core.integrations.transformers import PatPagedAttention
    from pat_core.workloads import build_tree_batch
    hq, hk, d, ps, rows = 8, 2, 64, 16, 64
    b = build_tree_batch("1,6_48,20", page_size=ps, seed=3)
    indptr, indices, last = BlockTable.from_padded(b.block_tables, b.seq_lens, ps).to_csr()
    n = b.batch_size * tokens
    qo = None if tokens == 1 else np.arange(0, n + 1, tokens, dtype=np.int32)
    g = torch.Generator(device="cuda").manual_seed(5)
    k, v = (torch.randn((b.num_pages, ps, hk, d), generator=g, device="cuda").half()
            for _ in range(2))
    q = torch.zeros((rows, hq, d), device="cuda", dtype=torch.float16)
    q[:n] = torch.randn((n, hq, d), generator=g, device="cuda").half()
    cache = types.SimpleNamespace(block_size=ps, key_cache=[k], max_batch_tokens=rows)

    def step(busy):
        fn = PatPagedAttention("paged|pat_stream_test")     # fresh wrappers and states
        fn._shape = (hq, hk, d, None, torch.float16, q.device)
        stream = torch.cuda.Stream()                        # torch's: non-blocking
        io = types.SimpleNamespace(compute_stream=stream,
                                   read_index_storage=torch.empty((1, 4096)))
        torch.cuda.synchronize()
        junk = cp.full(1 << 22, -1, dtype=cp.int32)
        del junk                        # its memory back in CuPy's pool, not zero
        if busy:
            torch.cuda._sleep(400_000_000)                  # ~0.2 s on the default stream
        runner = fn.plan_graph_step(indptr, indices, last, qo, cache, io, rows)
        assert bool(getattr(runner, "use_cuda_graph", False)) == (tokens == 1)
        with torch.cuda.stream(stream):
            if tokens == 1:
                out = torch.zeros_like(q)
                runner.run(q, (k, v), out=out)
            else:
                out = runner.run(q[:n], (k, v))
        torch.cuda.synchronize()
        return out[:n]

    assert torch.equal(step(True), step(False))


@needs_hf
def test_register_pat_refuses_bad_names():
    from pat_core.integrations.transformers import register_pat
    with pytest.raises(ValueError, match="name"):
        register_pat("pat")
    with pytest.raises(ValueError, match="fallback"):
        register_pat("paged|pat_x", fallback="paged|nothing_registered")
    with pytest.raises(ValueError, match="fallback"):
        register_pat("paged|pat_y", fallback="paged|pat_y")
