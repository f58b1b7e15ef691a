"""One module per `cppo-megatron` command (see cli.COMMANDS)."""
