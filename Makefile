.PHONY: quickstart test test-fast docs

quickstart:  ## install and run the quickstart (CONFIG=configs/smollm2.yaml: the real-model run)
	CONFIG=$(CONFIG) bash scripts/quickstart.sh $(ARGS)

test:  ## install and run every test (what CI runs)
	bash scripts/test.sh

test-fast:  ## the fast set, about a minute
	bash scripts/test.sh -m "not slow" -n 2

docs:  ## regenerate the command-line and configuration references, then build the site into site/
	.venv/bin/streamrl config --markdown > docs/reference/config.md
	.venv/bin/python -m typer streamrl.cli utils docs --name streamrl --title "Command-line reference" \
		--output docs/reference/cli.md
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict
