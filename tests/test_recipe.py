import pytest

from eyas.configbase import ConfigError
from eyas.recipe import list_recipes, load_recipe


def test_overrides_reach_their_section():
    r = load_recipe("smollm2-135m-cpu", ["train.lr=3e-4", "data.max_length=256", "bench.decoder.depth=7"])
    assert r.train.lr == pytest.approx(3e-4)
    assert r.data.max_length == 256
    assert r.bench.decoder.depth == 7


def test_unknown_key_names_the_closest_valid_one():
    with pytest.raises(ConfigError, match=r"unknown key 'train.lrr'.*did you mean 'lr'"):
        load_recipe("smollm2-135m-cpu", ["train.lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown key 'traim'.*'train'"):
        load_recipe(None, ["traim.lr=1"])


def test_unknown_key_inside_a_yaml_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("data:\n  corpora:\n    - kind: sharegpt\n      max_recrods: 3\n")
    with pytest.raises(ConfigError, match=r"data.corpora.*max_recrods.*max_records"):
        load_recipe(str(path))


def test_wrong_types_are_refused():
    with pytest.raises(ConfigError, match="train.epochs"):
        load_recipe(None, ["train.epochs=abc"])
    with pytest.raises(ConfigError, match="train.batch_size"):
        load_recipe(None, ["train.batch_size=true"])


def test_unknown_recipe_name_suggests_a_shipped_one():
    with pytest.raises(ConfigError, match="smollm2-135m-cpu"):
        load_recipe("smollm2-135m-cpuu")


def test_every_shipped_recipe_loads():
    names = list_recipes()
    assert "smollm2-135m-cpu" in names
    for name in names:
        recipe = load_recipe(name)
        assert recipe.name
        assert recipe.output_dir


def test_base_recipe_is_merged_underneath(tmp_path):
    path = tmp_path / "child.yaml"
    path.write_text("base: smollm2-135m-cpu\noutput_dir: runs/child\ntrain:\n  lr: 0.002\n")
    child, parent = load_recipe(str(path)), load_recipe("smollm2-135m-cpu")
    assert child.name == "child" and child.output_dir == "runs/child"
    assert child.train.lr == pytest.approx(0.002)
    assert child.train.epochs == parent.train.epochs  # untouched keys come from the base
    assert child.data == parent.data


def test_base_cycle_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text(f"base: {tmp_path / 'b.yaml'}\n")
    (tmp_path / "b.yaml").write_text(f"base: {tmp_path / 'a.yaml'}\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_recipe(str(tmp_path / "a.yaml"))


def test_every_recipe_names_an_accelerate_config_that_exists():
    from eyas.recipe import recipes_dir

    for name in list_recipes():
        recipe = load_recipe(name)
        assert recipe.accelerate_config, name
        assert (recipes_dir() / "accelerate" / recipe.accelerate_config.split("/")[-1]).exists(), name
