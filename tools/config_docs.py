"""Render docs/configuration.md from BatonConfig, so the page can't drift from the code.

A docs generator, kept out of the runtime package: ``python tools/config_docs.py >
docs/configuration.md``; tests/core/test_config.py compares them.
"""

from __future__ import annotations

from baton.config.overrides import all_section_models
from baton.plugins.registry import get_registry

HEADER = """# Configuration

One settings model (`baton.config.BatonConfig`), eleven sections of baton-core and the
sections installed plugins register (`register_config_sections`: baton-plugin-openai's
`[server]`), every one optional. Sources, strongest first:

1. explicit arguments: `LLM(max_num_seqs=8)`, `LLM(scheduler={"policy": "priority"})`,
   `LLM(**{"cache.block_size": 32})`, CLI flags (`--policy`, `--set cache.block_size=32`);
2. environment variables `BATON_<SECTION>__<FIELD>` (e.g. `BATON_SCHEDULER__MAX_NUM_SEQS=8`);
3. a TOML or YAML file given with `--config` / `LLM(config=...)` or `BATON_CONFIG`;
4. the defaults below.

Invalid values fail at start-up with the field path and the bad value
(`scheduler.max_num_seqs: Input should be greater than 0 (got 0)`); a config
naming a plugin that is not installed fails with what is installed and what to
install. An unknown key in a section is refused unless it is the sub-table of
an installed plugin of that section's kind.

A plugin's own settings sit in a sub-table named after it and are validated by
the settings model it registered; a key that model has no field for is refused
(naming the key, the plugin and its settings), whatever the model's own `extra`
says. On the command line a dotted key reaches into the sub-table:
`--set transport.zmq.protocol=tcp` (`BATON_TRANSPORT__ZMQ__PROTOCOL=tcp` in the
environment).

```toml
[transport]
name = "zmq"
[transport.zmq]
protocol = "tcp"
```

`baton config check [FILE]` checks a config (with `BATON_*` variables and the
same flags and `--set` as `baton generate`) against every installed plugin's
settings without loading a model or tokenizer: it prints the selected plugins
and exits 0, or prints every problem and exits 1 (`--json`: `ok`, `error`, and
`problems`, one string each). Values the config refuses and plugin problems are
reported together: a refused value is listed and put back to its default so the
plugins are still checked; only a refusal across sections (e.g. a quantization
with tensor parallelism) stops before the plugins, and says so. `LLM`,
`AsyncLLM` and `baton generate` / `chat` / `serve` run the same checks before
anything loads (and stop at the first refused value).

Other environment switches: `BATON_PLUGINS` (comma-separated allowlist of
plugin or distribution names; baton-core's built-ins always load),
`BATON_DISABLE_PLUGIN_AUTOLOAD=1`, `BATON_TRACE_PLUGINS=1` (log every hook
call), `BATON_CACHE_DIR` (where converted models are kept), `BATON_LOG_LEVEL`
(the CLI's log level), `BATON_START_METHOD` (`forkserver`, the default on Linux:
engine and worker processes fork from a server that imported torch and
transformers once, so each starts in well under a second instead of 3-6 s; or
`spawn`: a fresh interpreter per process).
"""


def render() -> str:
    out = [HEADER]
    plugins = {e.name: e.distribution for e in get_registry().of_kind("config_section")}
    for section, model in all_section_models().items():
        owner = f" ({plugins[section]})" if section in plugins else ""
        out += [f"## [{section}]{owner}", "", "| field | default | meaning |", "|---|---|---|"]
        for name, field in model.model_fields.items():
            default = (
                field.default_factory() if field.default_factory is not None else field.default
            )  # type: ignore[call-arg]
            meaning = " ".join((field.description or "").split())
            out.append(f"| `{name}` | `{default!r}` | {meaning} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
