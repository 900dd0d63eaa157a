"""``python -m app.cli``: the ``saltserve`` command."""

from app.cli.main import main

if __name__ == "__main__":  # not when imported (pkgutil.walk_packages imports every module)
    main()
