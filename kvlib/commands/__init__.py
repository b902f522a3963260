"""The command line's subcommands, one module each: its arguments (`add_parser`) and what it does (`handle`);
kvlib.cli puts them together."""
