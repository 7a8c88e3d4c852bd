"""The fixed ~200-token benchmark prompt (written for this project)."""
BENCH_PROMPT = (
    "The old lighthouse keeper kept a notebook in which he wrote down every ship that passed the point. "
    "Over forty years the notebook grew into a shelf of volumes, each one bound in blue cloth and labelled "
    "with the years it covered. He recorded the weather, the direction of the wind, the colour of the sea, "
    "and the names of the vessels when he could read them through his brass telescope. Fishermen in the "
    "village laughed at the habit at first, but when a storm wrecked the harbour wall they came to him to "
    "learn how high the water had risen in earlier storms, and his careful pages told them. Scientists from "
    "the university later borrowed the notebooks to study how the climate of the coast had changed. When the "
    "keeper finally retired, he gave the whole shelf to the village library, where children still read them "
    "on rainy afternoons. Write a short story that continues this account, describing the keeper's last night "
    "in the lighthouse and what he saw from the window."
)
