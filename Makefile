.PHONY: quickstart test test-fast

quickstart:  ## install and run the quickstart (CONFIG=configs/smollm2.yaml: the real-model run)
	CONFIG=$(CONFIG) bash scripts/quickstart.sh $(ARGS)

test:  ## install and run every test (what CI runs)
	bash scripts/test.sh

test-fast:  ## the fast set, about a minute
	bash scripts/test.sh -m "not slow"
