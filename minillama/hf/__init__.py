"""minillama's KV cache inside Hugging Face transformers: any model's attention reads its keys and
values from minillama's rings and codecs (``cache.py``), and the cached-path ruler runs on it
(``ruler.py``). An integration wing over the core: only this wing imports transformers, an
optional extra (``pip install "minillama[hf]"``)."""
