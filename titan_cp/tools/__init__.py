"""Tools around the package: measurement and self-checks that scripts/ wrap in thin CLIs."""
