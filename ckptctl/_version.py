__version__ = "0.1.0"
# The version of every --json document the CLI prints (docs/schemas/, docs/CLI_JSON.md): one for all commands.
SCHEMA_VERSION = 1
