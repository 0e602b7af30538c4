//! The layer API as an outside client sees it: HF names by default, the head-aligned output
//! projection range from the layout, checked loader paths, tied heads in a chosen dtype.

use std::time::Duration;
use tp_comm::DeviceGroup;
use tp_core::{DType, Device, Tensor};
use tp_layers::{LayerError, LoadOptions, Loader, ParallelLmHead, Projections, QkvLayout, VocabParallelEmbedding};

#[test]
fn projections_default_to_the_hugging_face_names() {
    assert_eq!(Projections::<3>::default(), Projections::Separate(["q_proj", "k_proj", "v_proj"]));
    assert_eq!(Projections::<2>::default(), Projections::Separate(["gate_proj", "up_proj"]));
}

#[test]
fn the_output_projection_columns_follow_the_query_heads() {
    // 12 query heads over 4 KV heads at TP 8: heads 2,2,2,2,1,1,1,1, head_dim 10.
    let cols: Vec<_> = (0..8).map(|r| QkvLayout::new(12, 4, 10, r, 8).unwrap().o_proj_columns()).collect();
    assert_eq!(cols[0], 0..20);
    assert_eq!(cols[1], 20..40);
    assert_eq!(cols[4], 80..90);
    assert_eq!(cols[7], 110..120);
    // They tile the full width, in rank order.
    assert!(cols.windows(2).all(|w| w[0].end == w[1].start));
}

#[test]
fn loader_paths_with_an_empty_segment_fail_at_the_first_read() {
    let dir = std::env::temp_dir().join(format!("tp-layer-api-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("model.safetensors");
    let w = Tensor::rand(&[4, 3], DType::F32, 1, &Device::Cpu).unwrap();
    tp_layers::save(&file, &[("model.layers.0.mlp.w", &w)]).unwrap();
    let ckpt = tp_layers::Checkpoint::open(&file).unwrap();
    let g = DeviceGroup::local(1, Duration::from_secs(10), |_| Device::Cpu).unwrap().remove(0);
    let root = Loader::new(&ckpt, &g, LoadOptions::new());
    // A dotted path is the same as its levels.
    assert_eq!(root.pp("model.layers.0").pp("mlp").prefix(), root.pp("model").pp("layers").pp(0).pp("mlp").prefix());
    assert_eq!(root.pp("model.layers.0.mlp").dims("w").unwrap(), vec![4, 3]);
    for bad in ["model..layers.0.mlp", ".model.layers.0.mlp", "model.layers.0.mlp.", ""] {
        let ld = root.pp(bad);
        assert!(!ld.contains("w"), "{bad:?}");
        match ld.full("w") {
            Err(LayerError::Config(m)) => assert!(m.contains("empty path segment"), "{bad:?}: {m}"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    assert!(matches!(root.pp("model.layers.0.mlp").full("w..x"), Err(LayerError::Config(_))));
}

#[test]
fn a_tied_head_shares_the_table_or_converts_it_when_asked() {
    let g = DeviceGroup::local(1, Duration::from_secs(10), |_| Device::Cpu).unwrap().remove(0);
    let table = Tensor::rand(&[7, 5], DType::BF16, 3, &Device::Cpu).unwrap();
    let emb = VocabParallelEmbedding::from_full(&table, &g).unwrap();
    assert_eq!(ParallelLmHead::tied(&emb).dtype(), DType::BF16);
    let head = ParallelLmHead::tied_as(&emb, DType::F32).unwrap();
    assert_eq!(head.dtype(), DType::F32);
    assert_eq!(head.weight().unwrap().to_f64_vec().unwrap(), table.to_f64_vec().unwrap());
}

#[test]
fn a_configs_hidden_act_names_the_activation() {
    use tp_core::Activation;
    assert_eq!(Activation::from_hidden_act("silu"), Some(Activation::Silu));
    assert_eq!(Activation::from_hidden_act("swish"), Some(Activation::Silu));
    assert_eq!(Activation::from_hidden_act("gelu_pytorch_tanh"), Some(Activation::GeluTanh));
    assert_eq!(Activation::from_hidden_act("relu"), None);
}
