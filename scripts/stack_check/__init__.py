"""`make stack-check`: the production stack of docker/compose.yaml, built and run for real, end to end.

    make stack-check                 # Podman (installed with apt when missing), as CI runs it
    ENGINE=docker make stack-check   # Docker Engine with the compose plugin
    GPU=1 make stack-check           # also builds docker/Dockerfile.gpu (its CUDA layer: ~2.7 GB of wheels)
    KEEP_STACK=1 make stack-check    # leaves the stack up for a look (then: podman-compose -p NAME down -v)

What each step does and each row of its closing table means: docs/PRODUCTION.md, "The stack check".
"""
