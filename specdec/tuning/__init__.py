"""Machine tuning: every start-up choice a model service makes for the machine it runs on.

Heap, OpenMP and thread placement (`heap`, `openmp`, `thread_placement`, `threads`), and the
measured choices: the int4 kernel, the output head, the dense kernels, compiled layers and
the forward cost table (`startup`). Every measurement goes through one timing helper
(`timing.interleaved_times`); every choice is recorded with its reason (`choices`), logged in
one line and reported in `Info`; measured choices are kept on disk keyed by what they depend on
(`store`), so a restart on the same machine reuses them instead of timing again. The model
code (`specdec.model`) holds the kernels and modules and takes the choices as arguments.
"""
