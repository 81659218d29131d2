import logging

# bitsandbytes (optim=adamw8bit), which diffusers imports whenever it is installed, logs at its import that optional
# CPU kernels (4-bit inference, fetched from a hub) are missing on CPUs with AVX512-BF16: nothing wanexp uses, and
# nothing a user can act on. Its errors still show.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
