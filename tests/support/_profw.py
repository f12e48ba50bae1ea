import cProfile, os, sys
if __name__ == "__main__":
    from tests.support.fake_te.activate import activate
    activate()
    from tests.support.matrix_worker import main
    r = os.environ.get("RANK","0")
    cProfile.runctx("main(*sys.argv[1:4])", globals(), locals(), f"/tmp/prof/out.rank{r}.prof")
