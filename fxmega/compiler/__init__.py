"""What torch.compile makes of a step, and the settings it is made with: the aot_eager
backend that shows its graphs, inductor's communication-overlap passes, reading the generated
code, and dumping the kernels (``--dump-kernels``)."""
