"""``shadowradix run``: decode prompts through the runner and print a closing summary."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import torch
from tqdm import tqdm

from adapters.cli.flag_checks import (
    FlagError,
    check_chunk,
    check_device,
    check_hisparse,
    check_pools,
    check_speculative,
    check_temperature,
    in_flag_terms,
    shape_config,
)
from adapters.engine.budget_runner import budget_runner
from adapters.engine.drafts import DraftSource
from adapters.engine.eagle_draft import EagleDraft
from adapters.engine.runner import GenerationResult, Runner, SchedulePolicy
from adapters.engine.sampling import MAX_TEMPERATURE, SamplingParams
from adapters.memory.device import resolve_device
from adapters.memory.formats import CacheFormat
from adapters.model.eagle import load_shipped_eagle
from adapters.model.model_config import ModelConfig, preset
from adapters.model.tempered import MIN_TEMPERATURE
from adapters.model.tokenizer import ByteTokenizer
from adapters.model.weights import ModelWeights
from adapters.model.weights_file import (
    SHIPPED,
    WeightsError,
    default_preset,
    load_shipped,
    load_weights,
)
from shadowradix import ConfigError, InvalidRequestError

DEFAULT_FULL_TOKENS, DEFAULT_SWA_TOKENS = 64 * 1024, 8 * 1024


def build_runner(args: argparse.Namespace) -> Runner:
    """The runner ``args`` describe: pools of ``--full-tokens`` / ``--swa-tokens``, or sized
    from ``--pool-budget-gib`` and re-balanced at run time. Raises `ValueError` for
    contradicting options, `FlagError` (naming the flag) for a value the runner would refuse."""
    check_device(args.device)
    model = preset(args.model if args.model is not None else default_preset())
    if args.layers is not None:
        if args.weights is None and model.name in SHIPPED and args.layers != model.num_layers:
            raise ValueError(
                f"--layers {args.layers}: the shipped {model.name} weights hold all "
                f"{model.num_layers} layers; use --model tiny (random weights) or --weights FILE"
            )
        model = model.first_layers(args.layers)
    _check_flags(args, model)
    device = resolve_device(args.device)
    overlapped = args.graph_decode == "on" and device.type == "cuda" and not args.speculative
    if overlapped and args.hisparse_pages is not None and args.max_running > args.hisparse_pages:
        raise FlagError(
            f"--graph-decode on with --hisparse-pages {args.hisparse_pages}: overlapped decode of "
            f"--max-running {args.max_running} requests writes up to a page each a step, more "
            f"than the buffer holds: at most --max-running {args.hisparse_pages}"
        )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the Runner's default
    weights = _weights(args, model, device, dtype)
    options = dict(
        device=device,
        dtype=dtype,
        weights=weights,
        chunk_tokens=args.chunk_tokens,
        max_running=args.max_running,
        hisparse_pages=args.hisparse_pages,
        graph_decode={"auto": None, "on": True, "off": False}[args.graph_decode],
        tail_only=args.tail_only,
        speculative_tokens=args.speculative,
        draft=_draft(args, weights),
        memory_budget=_budget_bytes(args.memory_budget_gib),
        index_format=CacheFormat[args.index_format.upper()],
        swa_format=CacheFormat[args.swa_format.upper()],
        schedule=SchedulePolicy(args.schedule),
    )
    cache_kwargs = dict(
        bounded_replay=args.bounded_replay, speculative=args.speculative is not None
    )
    budget = getattr(args, "pool_budget_gib", None)
    ratio = getattr(args, "swa_full_ratio", None)
    if budget is None:
        if ratio is not None:
            raise ValueError("--swa-full-ratio needs --pool-budget-gib")
        cache = model.cache_config(
            page_size=args.page_size,
            full_capacity=args.full_tokens or DEFAULT_FULL_TOKENS,
            swa_capacity=args.swa_tokens or DEFAULT_SWA_TOKENS,
            **cache_kwargs,
        )
        check_chunk(cache, args.chunk_tokens)
        return Runner(model, cache, **options)  # type: ignore[arg-type]
    if args.full_tokens is not None or args.swa_tokens is not None:
        raise ValueError("--pool-budget-gib sizes the pools: drop --full-tokens / --swa-tokens")
    if args.hisparse_pages is not None:
        raise ValueError("--pool-budget-gib re-balances pools at run time, which HiSparse does "
                         "not support: drop one of --pool-budget-gib / --hisparse-pages")
    if ratio is None:
        ratio = DEFAULT_SWA_TOKENS / DEFAULT_FULL_TOKENS
    try:
        return budget_runner(
            model,
            int(budget * 2**30),
            ratio,
            page_size=args.page_size,
            cache_kwargs=cache_kwargs,
            **options,  # type: ignore[arg-type]
        )
    except ConfigError as exc:  # a budget too small for one window, say
        ratio_flag = "" if args.swa_full_ratio is None else f" --swa-full-ratio {ratio:g}"
        raise ValueError(f"--pool-budget-gib {budget:g}{ratio_flag}: {in_flag_terms(str(exc))}"
                         ) from exc  # fmt: skip


def _check_flags(args: argparse.Namespace, model: ModelConfig) -> None:
    """The flag values the cache or the runner would refuse, as `FlagError`s naming them
    (those that depend on pools sized from ``--pool-budget-gib`` are the runner's)."""
    p, speculative = args.page_size, args.speculative is not None
    shape = shape_config(model.cache_config, p, model.window, speculative=speculative)
    if getattr(args, "pool_budget_gib", None) is None:  # (with it: no HiSparse, exit 2)
        full = args.full_tokens or DEFAULT_FULL_TOKENS
        check_pools(shape, full, args.swa_tokens or DEFAULT_SWA_TOKENS)
        paged = args.speculative if args.graph_decode != "on" else None  # verify paged
        check_hisparse(args.hisparse_pages, model.index_topk, paged, p)
    check_speculative(shape, args.speculative, args.bounded_replay)
    check_temperature(args.temperature, MIN_TEMPERATURE, MAX_TEMPERATURE)


def _weights(
    args: argparse.Namespace, model: ModelConfig, device: torch.device, dtype: torch.dtype
) -> ModelWeights | None:
    """``--weights PATH``, else a trained preset's shipped file (checked against its recorded
    SHA-256), else ``None``: the preset's seeded random weights. Raises `WeightsError`, `OSError`
    naming ``--weights``."""
    if getattr(args, "weights", None) is not None:
        try:
            return load_weights(args.weights, model, device, dtype)
        except OSError as exc:  # missing, a directory, unreadable
            raise OSError(f"--weights {args.weights}: {exc.strerror or exc}") from None
    if model.name in SHIPPED:
        return load_shipped(model, device, dtype)
    return None


def _draft(args: argparse.Namespace, weights: ModelWeights | None) -> DraftSource | None:
    """``--draft eagle``: the shipped EAGLE head of the target's weights (`WeightsError` where
    the preset has none); ``mtp`` or nothing: the runner's default (the MTP layer)."""
    name = getattr(args, "draft", None)
    if name is None or name == "mtp":
        if name is not None and args.speculative is None:
            raise ValueError("--draft needs --speculative K")
        return None
    if args.speculative is None:
        raise ValueError("--draft needs --speculative K")
    if weights is None:
        raise WeightsError(args.model or "the model", "an EAGLE head needs trained weights")
    return EagleDraft(load_shipped_eagle(weights))


def _weights_source(args: argparse.Namespace, model: ModelConfig) -> str:
    if getattr(args, "weights", None) is not None:
        return str(args.weights)
    return "shipped trained" if model.name in SHIPPED else f"random (seed {model.seed})"


def _budget_bytes(gib: float | None) -> int | None:
    if gib is None:
        return None
    if not gib * 2**30 >= 1:
        raise FlagError(f"--memory-budget-gib {gib:g}: less than one byte")
    return int(gib * 2**30)


def _budget_note(args: argparse.Namespace) -> str:
    budget = getattr(args, "pool_budget_gib", None)
    return "" if budget is None else f" (from {budget:g} GiB, re-balanced at run time)"


def run_command(args: argparse.Namespace, texts: list[str]) -> int:
    tok = ByteTokenizer()
    runner = build_runner(args)
    params = SamplingParams(args.max_new_tokens, args.temperature, args.seed, stop_token=tok.eos)
    print(
        f"shadowradix run: model {runner.model.name} ({runner.model.num_layers} layers, ratios "
        f"{runner.model.compress_ratios}), {_weights_source(args, runner.model)} weights in "
        f"{runner.weights.dtype} on {runner.device}, page "
        f"{runner.cache.config.page_size}, pools {runner.cache.config.full_capacity} full / "
        f"{runner.cache.config.swa_capacity} SWA tokens{_budget_note(args)}, {len(texts)} "
        "prompt(s)",
        flush=True,
    )
    pending = [tok.encode(t) for t in texts]
    bars = _Progress(sum(len(p) for p in pending), len(pending) * args.max_new_tokens, args.quiet)
    results: list[GenerationResult] = []
    start, step, refused, order = time.perf_counter(), 0, 0, 0
    ids: dict[int, int] = {}
    while pending or runner.num_pending:
        # one prompt every --arrival-steps steps; never an idle step while prompts wait
        due = args.arrival_steps <= 0 or step % args.arrival_steps == 0 or not runner.num_pending
        if pending and due:
            batch = pending if args.arrival_steps <= 0 else pending[:1]
            for prompt in batch:
                try:  # prompt i samples with seed + i: equal prompts get their own samples
                    own = dataclasses.replace(params, seed=args.seed + order)
                    ids[runner.submit(prompt, own)] = order
                except InvalidRequestError as exc:  # the others still run
                    bars.note(f"[{order}] refused: {in_flag_terms(str(exc))}")
                    refused += 1
                    bars.refuse(len(prompt), args.max_new_tokens)
                order += 1
            pending = pending[len(batch) :]
        done = runner.step()
        step += 1
        bars.update(runner.stats.prefill_tokens, runner.stats.generated_tokens)
        for res in done:
            bars.finished(res, args.max_new_tokens)
        results += done
    bars.finish()
    wall = time.perf_counter() - start
    failed = _report(results, ids, tok, args.quiet)
    print(summary(runner, results, wall))
    return 1 if refused or failed else 0


def _report(
    results: list[GenerationResult], ids: dict[int, int], tok: ByteTokenizer, quiet: bool
) -> int:
    """Prints each completion (unless ``quiet``) in prompt order, and one line on stderr per
    request that failed; returns how many failed."""
    failed = 0
    for res in sorted(results, key=lambda r: ids[r.request_id]):
        if res.finish_reason == "error":
            print(f"[{ids[res.request_id]}] error: {res.error}", file=sys.stderr)
            failed += 1
        elif not quiet:
            flag = ", approximate" if res.approximate else ""
            print(
                f"[{ids[res.request_id]}] {res.finish_reason:>6} "
                f"(hit {res.cached_tokens} tok{flag}): {tok.decode(res.output)!r}"
            )
    return failed


class _Progress:
    """One bar on stderr over every prompt and output token: long prompts take a while before
    their first output token, so prefill counts too (its share is in the postfix)."""

    def __init__(self, prompt_tokens: int, output_tokens: int, quiet: bool) -> None:
        self.prompt, self.output, self.prefilled, self.decoded = prompt_tokens, output_tokens, 0, 0
        self.bar = tqdm(total=prompt_tokens + output_tokens, desc="tokens", unit="tok",
                        unit_scale=True, disable=quiet, file=sys.stderr)  # fmt: skip

    def update(self, prefilled: int, decoded: int) -> None:
        """The runner's running totals: prompt tokens computed and output tokens generated so
        far (reused prompt tokens never count: `finished` takes them off the total)."""
        gain = max(0, min(prefilled, self.prompt) - self.prefilled)
        self.prefilled += gain
        step = max(0, min(decoded, self.output) - self.decoded)
        self.decoded += step
        self.bar.update(gain + step)
        self.bar.set_postfix_str(
            f"prefill {self.prefilled}/{self.prompt}, decode {self.decoded}/{self.output}",
            refresh=False,
        )

    def note(self, message: str) -> None:
        """A line on stderr above the bar (never inside it)."""
        tqdm.write(message, file=sys.stderr)

    def refuse(self, prompt_len: int, output_len: int) -> None:
        """A prompt that will never run: its tokens leave the total."""
        self.prompt -= prompt_len
        self.output -= output_len
        self.bar.total = self.prompt + self.output
        self.bar.refresh()

    def finished(self, result: GenerationResult, max_new_tokens: int) -> None:
        """A request that finished: its reused prompt tokens and the output tokens it will
        never generate (an early EOS, an error) leave the total, so the bar reaches 100 % when
        the last request ends."""
        self.prompt -= min(result.cached_tokens, self.prompt - self.prefilled)
        self.output -= min(max_new_tokens - len(result.output), self.output - self.decoded)
        self.bar.total = self.prompt + self.output

    def finish(self) -> None:
        """Closes the bar at 100 %: prompt tokens reused and outputs that stopped early (EOS)
        are work that was never needed."""
        self.bar.n = self.bar.total
        self.bar.set_postfix_str(
            f"prefill {self.prefilled}/{self.prompt}, decode {self.decoded}/{self.output}",
            refresh=False,
        )
        self.bar.close()


def _draft_name(runner: Runner) -> str:
    draft = getattr(runner.spec, "draft", None)
    return "EAGLE head" if isinstance(draft, EagleDraft) else "MTP layer"


def _paths_line(runner: Runner) -> str:
    p = runner.paths
    kern = "Triton kernels" if p.kernels == "triton" else "torch references (no fused kernels)"
    copies = f", HiSparse copies {p.hisparse_copies}" if p.hisparse_copies else ""
    return f"paths: {kern}, decode {p.decode} ({p.scheduling}){copies}"


def summary(runner: Runner, results: list[GenerationResult], wall: float) -> str:
    st, cs = runner.stats, runner.cache.stats()
    out_tokens = sum(len(r.output) for r in results)
    lines = [
        f"requests {len(results)}, steps {st.steps}, wall {wall:.2f} s",
        f"tokens/s: {out_tokens / wall:.1f} generated, "
        f"{(st.prefill_tokens + st.decode_tokens) / wall:.1f} processed "
        f"({st.prefill_tokens} prefill + {st.decode_tokens} decode)",
        f"prompt hit ratio {cs.hit_ratio:.3f} ({cs.hit_tokens} of {cs.prompt_tokens} prompt tokens "
        f"reused; min hit granularity {cs.min_hit_granularity})",
        f"pools: full {cs.full.used_fraction:.1%} used ({cs.cached_tokens} tokens cached), "
        f"SWA {cs.swa.used_fraction:.1%} used ({cs.cached_window_tokens} window tokens live)",
        f"evictions: {cs.evicted.full_pages} full + {cs.evicted.swa_pages} SWA pages, "
        f"{cs.evicted.nodes_removed} nodes removed, {cs.evicted.nodes_tombstoned} tombstoned; "
        f"preemptions {st.preemptions}"
        + (
            f"; pool re-balances {st.rebalances} ({st.rebalance_moved_pages} pages moved)"
            if st.rebalances
            else ""
        ),  # fmt: skip
        f"time: forward {st.forward_s:.2f} s, scheduling + cache {st.schedule_s:.2f} s",
        _paths_line(runner),
    ]
    if st.shared_prefill_waits:
        lines.append(
            f"shared prefills: {st.shared_prefill_waits} admission(s) waited for a running "
            "prefill of their prefix instead of computing it again"
        )
    replay = runner.cache.config.bounded_replay  # tail-only approximations have their own line
    if st.replayed_hits or (replay and st.approximate_results):
        lines.append(
            f"bounded replay (approximate): {st.replayed_hits} replayed hits, "
            f"{st.replayed_tokens} window tokens recomputed, {st.approximate_results} of "
            f"{len(results)} results approximate"
        )
    if runner.offload is not None:
        hs = runner.offload.coordinator.stats()
        lines.append(
            f"HiSparse: {runner.offload.device_pages} device pages per C4 layer, eager steps' "
            f"reads hit {hs.read_hits / max(1, hs.reads):.1%}, {hs.swap_ins} swap-ins, "
            f"{hs.evictions} evictions, {hs.backups} backups"
        )
    res = runner.model_runner.graph_hisparse
    if res is not None:  # graph steps: entries read from the buffer or the mirror (zero-copy)
        hit, read = res.hit_rate()
        gs = res.stats
        lines.append(
            f"HiSparse in graph steps: {hit / max(1, read):.1%} of {read} entries read from the "
            f"buffer, the rest from the host mirror; {gs.commits} commits, {gs.swap_in_pages} "
            f"pages copied in, {gs.missed_pages} missed ({gs.dropped_misses} left on the host)"
        )
    if runner.spec is not None:
        sp = runner.spec.stats
        lines.append(
            f"speculative decoding: k={runner.spec_tokens} ({_draft_name(runner)}), "
            f"{sp.forwards} verify forwards, mean "
            f"acceptance length {sp.mean_acceptance_length:.2f}, acceptance rate "
            f"{sp.acceptance_rate:.1%}, drafting {sp.draft_s:.2f} s"
        )
    if runner.tail_only:
        approx = sum(r.approximate for r in results)
        lines.append(
            f"tail-only prefill: {st.tail_skipped_tokens} tokens skipped after layer "
            f"{runner.model.last_kv_source} in {st.tail_only_forwards} forwards; {approx} of "
            f"{len(results)} results approximate"
        )
    if runner.device.type == "cuda":
        lines.append(
            f"GPU memory peak {torch.cuda.max_memory_allocated(runner.device) / 2**30:.2f} GiB"
        )
    return "\n".join(lines)
