"""One test per hookspec (test_hook_<name>, required by test_meta): a plugin object implementing the
hook is registered, its registration reaches the registry, and what it registered is used by the kernel.
"""

from __future__ import annotations

import threading

import torch

from baton import hookimpl
from baton.config import BatonConfig
from baton.engine.core import EngineCore
from baton.plugins.registry import Plugins, get_plugins
from baton.plugins.resolve import resolve_plugins
from baton.protocol import EngineCoreRequest, ModelInfo
from baton.sampling_params import SamplingParams, StructuredOutputSpec
from baton.sched.policies import FCFSPolicy
from baton.testing import FakeExecutor
from baton.transport.inproc import InprocTransport

INFO = ModelInfo(
    path="fake", architecture="Fake", vocab_size=32000, max_model_len=512, eos_token_ids=[0]
)


def plugins_with(plugin: object, name: str) -> Plugins:
    plugins = Plugins()
    plugins.load_entry_points({})
    plugins.register(plugin, name, "hook-test-dist", "1.2.3")
    return plugins


def serve(core: EngineCore, n: int = 3, **params) -> dict[str, list[int]]:
    for i in range(n):
        core.add_request(
            EngineCoreRequest(
                request_id=f"r{i}",
                prompt_token_ids=[5 + i, 6, 7, 8],
                eos_token_id=0,
                sampling_params=SamplingParams(temperature=0.0, max_tokens=4, **params),
            )
        )
    tokens: dict[str, list[int]] = {}
    for _ in range(200):
        if not core.has_work():
            break
        outs, _ = core.step_fn()
        for o in outs.outputs if outs else ():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not core.has_work()
    return tokens


def test_hook_register_scheduler_policies():
    admitted: list[str] = []

    class LastInFirstOut(FCFSPolicy):
        def add(self, request):
            self._queue.appendleft(request)

        def pop(self, request):
            admitted.append(request.request_id)
            super().pop(request)

    class Plugin:
        @hookimpl
        def register_scheduler_policies(self, register):
            register("lifo-hook", LastInFirstOut)

    plugins = plugins_with(Plugin(), "lifo-hook-plugin")
    entry = plugins.registry.get("scheduler_policy", "lifo-hook")
    assert (entry.plugin, entry.distribution, entry.version) == (
        "lifo-hook-plugin",
        "hook-test-dist",
        "1.2.3",
    )
    config = BatonConfig.load(policy="lifo-hook", max_model_len=512, max_num_seqs=1)
    core = EngineCore(config, registry=plugins.registry, executor=FakeExecutor(), info=INFO)
    assert isinstance(core.scheduler.policy, LastInFirstOut)
    tokens = serve(core)
    assert {k: len(v) for k, v in tokens.items()} == {"r0": 4, "r1": 4, "r2": 4}
    assert admitted == ["r2", "r1", "r0"]  # one seat: the newest goes first


def test_hook_register_executors():
    made: list[FakeExecutor] = []

    def factory(config, settings):
        made.append(FakeExecutor(block_size=config.cache.block_size, token_ids=[42]))
        return made[-1]

    class Plugin:
        @hookimpl
        def register_executors(self, register):
            register("fixed-hook", factory)

    plugins = plugins_with(Plugin(), "fixed-hook-plugin")
    assert plugins.registry.get("executor", "fixed-hook").distribution == "hook-test-dist"
    core = EngineCore(
        BatonConfig.load(executor="fixed-hook", max_model_len=512),
        registry=plugins.registry,
        info=INFO,
    )
    assert core.executor is made[0]
    assert serve(core) == {f"r{i}": [42] * 4 for i in range(3)}
    core.shutdown()


def test_hook_register_transports():
    class Plugin:
        @hookimpl
        def register_transports(self, register):
            register("inproc-hook", lambda config, settings: InprocTransport())

    plugins = plugins_with(Plugin(), "transport-hook-plugin")
    entry = plugins.registry.get("transport", "inproc-hook")
    transport = entry.create(BatonConfig.load(transport="inproc-hook"), None)
    client = transport.create_client(1)
    done = threading.Event()

    def engine() -> None:
        ch = transport.connect_engine(client.address, 0)
        frames = ch.recv(timeout=10)
        ch.send([b"echo", *frames])
        done.wait(10)
        ch.close()

    t = threading.Thread(target=engine)
    t.start()
    client.send([b"hello"], 0)
    assert [bytes(f) for f in client.recv(timeout=10)] == [b"echo", b"hello"]
    done.set()
    t.join()
    client.close()


class _OnlyToken:
    def __init__(self, token: int) -> None:
        self.token, self.accepted = token, 0

    def accept_tokens(self, token_ids) -> bool:
        ok = all(t == self.token for t in token_ids)
        self.accepted += len(token_ids) if ok else 0
        return ok

    def fill_bitmask(self, bitmask, row) -> None:
        bitmask[row] = 0
        bitmask[row, self.token // 32] = 1 << (self.token % 32)

    def is_terminated(self) -> bool:
        return self.accepted >= 2

    def rollback(self, num_tokens) -> None:
        self.accepted -= num_tokens


class _OnlyTokenBackend:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def compile(self, spec):
        return int(spec.choice[0])

    def matcher(self, compiled):
        return _OnlyToken(compiled)

    def allocate_bitmask(self, num_rows):
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)


def test_hook_register_structured_output_backends(monkeypatch):
    created: list[tuple] = []

    def factory(config, settings, tokenizer, vocab_size):
        created.append((tokenizer, vocab_size))
        return _OnlyTokenBackend(vocab_size)

    class Plugin:
        @hookimpl
        def register_structured_output_backends(self, register):
            register("only-token-hook", factory)

    plugins = plugins_with(Plugin(), "so-hook-plugin")
    assert plugins.registry.get("structured_output", "only-token-hook").plugin == "so-hook-plugin"
    # the fake model has no tokenizer; this backend does not need one
    monkeypatch.setattr("baton.engine.core.load_tokenizer", lambda model, info: "no-tokenizer")
    config = BatonConfig.load(structured_output="only-token-hook", max_model_len=512)
    core = EngineCore(config, registry=plugins.registry, executor=FakeExecutor(), info=INFO)
    tokens = serve(core, n=2, structured_outputs=StructuredOutputSpec(choice=["77"]))
    assert tokens == {"r0": [77, 77], "r1": [77, 77]}  # constrained, then terminated by the grammar
    assert created == [("no-tokenizer", 32000)]
    core.shutdown()


def test_hook_register_speculators():
    """A speculator that knows the fake model: every draft is accepted, outputs are unchanged,
    its settings sub-table reaches the factory and it sees each event."""
    from pydantic import BaseModel

    fake = FakeExecutor()
    events: list[tuple] = []

    class Settings(BaseModel):
        depth: int = 1

    class Seer:
        def __init__(self, depth: int) -> None:
            self.depth = depth

        def propose(self, request, max_tokens):
            tokens = list(request.all_token_ids)
            for _ in range(min(max_tokens, self.depth)):
                tokens.append(fake.next_token(tokens, request.num_prompt_tokens))
            return tokens[request.num_tokens :]

        def observe(self, request, num_proposed, num_accepted):
            events.append(("observe", request.request_id, num_proposed, num_accepted))

        def finished(self, request):
            events.append(("finished", request.request_id))

    class Plugin:
        @hookimpl
        def register_speculators(self, register):
            register("seer", lambda config, settings: Seer(settings.depth), Settings)

    plugins = plugins_with(Plugin(), "spec-hook-plugin")
    assert plugins.registry.get("speculator", "seer").plugin == "spec-hook-plugin"
    config = BatonConfig.load(
        max_model_len=512, speculative={"method": "seer", "num_tokens": 3, "seer": {"depth": 3}}
    )
    core = EngineCore(config, registry=plugins.registry, executor=fake, info=INFO)
    tokens = serve(core, n=2)
    core.shutdown()
    plain = EngineCore(BatonConfig.load(max_model_len=512), executor=FakeExecutor(), info=INFO)
    assert tokens == serve(plain, n=2)
    plain.shutdown()
    observed = [e for e in events if e[0] == "observe"]
    # after the first token, max_tokens=4 leaves room for 2 drafts and the model's own token
    assert observed and all(p == a == 2 for _, _, p, a in observed)
    assert sorted(e[1] for e in events if e[0] == "finished") == ["r0", "r1"]


def test_hook_register_stat_loggers(global_plugin):
    from baton.frontend.stat_loggers import StatLoggers
    from baton.metrics.stats import IterationStats

    seen: list[tuple] = []

    class Recorder:
        def __init__(self, config, settings, engine_index=0):
            seen.append(("created", engine_index))

        def record(self, scheduler_stats, iteration_stats, engine_index=0):
            seen.append(("record", iteration_stats.num_generation_tokens))

        def log(self):
            seen.append(("log",))

    class Plugin:
        @hookimpl
        def register_stat_loggers(self, register):
            register("recorder-hook", Recorder)

    global_plugin(Plugin(), "stat-hook-plugin")
    config = BatonConfig.load(**{"observability.stat_loggers": ["recorder-hook"]})
    factories = resolve_plugins(config).factories("stat_logger", config)
    loggers = StatLoggers(config.observability, factories, engine_index=3)
    loggers.record(None, IterationStats(timestamp=0.0, num_generation_tokens=5))
    loggers.log()
    assert seen == [("created", 3), ("record", 5), ("log",)]


def test_hook_register_commands(global_plugin, capsys):
    from baton.cli.main import main

    def hello_command(parser):
        """Say hello."""
        parser.add_argument("--who", default="world")

        def run(args):
            print(f"hello, {args.who} (config {args.config})")
            return 7

        return run

    class Plugin:
        @hookimpl
        def register_commands(self, register):
            register("hello-hook", hello_command)

    global_plugin(Plugin(), "command-hook-plugin")
    assert get_plugins().registry.get("command", "hello-hook").distribution == "hook-test-dist"
    assert main(["hello-hook", "--who", "baton"]) == 7
    assert capsys.readouterr().out.strip() == "hello, baton (config None)"


class _ThreadEngine:
    """An engine core on a thread of this process (an ``EngineHandle``): what a launcher for
    a place that runs Python functions does, with a real engine and the zmq transport."""

    def __init__(self, thread: threading.Thread, stop: threading.Event) -> None:
        self.thread, self.stop = thread, stop

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def terminate(self) -> None:
        self.stop.set()

    def kill(self) -> None:
        self.stop.set()  # a thread cannot be killed: the engine stops at its next step

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def describe(self) -> str:
        return f"thread {self.thread.name}"


class _ThreadLauncher:
    def __init__(self) -> None:
        self.launched: list[int] = []
        self.closed = False

    def launch(self, config, address, engine_index, fingerprint) -> _ThreadEngine:
        from baton.engine.launch import run_engine_core

        stop = threading.Event()
        thread = threading.Thread(
            target=run_engine_core,
            args=(config, address, engine_index, fingerprint),
            kwargs={"in_thread": True, "shutdown_event": stop},
            name=f"engine-{engine_index}",
            daemon=True,
        )
        thread.start()
        self.launched.append(engine_index)
        return _ThreadEngine(thread, stop)

    def close(self) -> None:
        self.closed = True


def test_hook_register_engine_launchers(global_plugin):
    from baton import LLM
    from baton.testing.tiny_model import tiny_model

    made: list[_ThreadLauncher] = []

    def factory(config, settings):
        made.append(_ThreadLauncher())
        return made[-1]

    class Plugin:
        @hookimpl
        def register_engine_launchers(self, register):
            register("threads", factory)

    global_plugin(Plugin(), "thread-launcher-plugin")
    model = str(tiny_model("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = [{"prompt_token_ids": [1, 2, 3]}]
    with LLM(model=model, max_model_len=64, device="cpu") as llm:
        expected = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(
        model=model,
        max_model_len=64,
        device="cpu",
        transport="zmq",
        data_parallel_backend="threads",
    ) as llm:
        (launcher,) = made
        assert launcher.launched == [0]
        handle = llm.engine.resources.procs[0]
        assert isinstance(handle, _ThreadEngine) and handle.is_alive()
        assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert launcher.closed and not handle.is_alive()  # terminated, joined, then closed
