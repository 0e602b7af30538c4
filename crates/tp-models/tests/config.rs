//! `config.json` in the forms real checkpoints use, and every bad field a typed error naming it.

use serde_json::{Value, json};
use tp_core::RopeScaling;
use tp_models::{Architecture, LayerType, ModelConfig, ModelError};

fn parse(v: Value) -> Result<ModelConfig, ModelError> {
    ModelConfig::from_json(v.as_object().unwrap())
}

/// TinyLlama-1.1B's config.json as the Hub serves it (transformers 4 form).
fn tinyllama() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5632,
        "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": 32,
        "num_hidden_layers": 22, "num_key_value_heads": 4, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": null, "rope_theta": 10000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
        "transformers_version": "4.35.0", "use_cache": true, "vocab_size": 32000
    })
}

#[test]
fn tinyllama_config_parses_with_defaults_filled() {
    let c = parse(tinyllama()).unwrap();
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!((c.hidden_size, c.intermediate_size, c.num_hidden_layers), (2048, 5632, 22));
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (32, 4, 64));
    assert_eq!((c.vocab_size, c.max_position_embeddings, c.rms_norm_eps), (32000, 2048, 1e-5));
    assert_eq!((c.rope_theta, c.rope_scaling), (10000.0, RopeScaling::Default));
    assert_eq!(c.eos_token_ids, vec![2]);
    assert!(!c.tie_word_embeddings && !c.qkv_bias && !c.o_bias && !c.mlp_bias);
    assert_eq!(c.sliding_window, None);
    assert_eq!(c.pad_token_id, None);
}

/// `pad_token_id` names the embedding row torch's `padding_idx` leaves untrained: negative ids
/// count from the end, as `nn.Embedding` reads them; null is none.
#[test]
fn the_pad_token_is_an_embedding_row() {
    for (id, row) in [(json!(2), Some(2)), (json!(0), Some(0)), (json!(-1), Some(31999)), (Value::Null, None)] {
        let mut c = tinyllama();
        c["pad_token_id"] = id.clone();
        assert_eq!(parse(c).unwrap().pad_token_id, row, "{id}");
    }
}

#[test]
fn llama3_scaling_reads_in_both_config_forms() {
    let want = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let mut v4 = tinyllama();
    v4["rope_theta"] = json!(500000.0);
    v4["rope_scaling"] = json!({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_type": "llama3"});
    v4["eos_token_id"] = json!([128001, 128008, 128009]);
    let c = parse(v4.clone()).unwrap();
    assert_eq!((c.rope_theta, c.rope_scaling), (500000.0, want.clone()));
    assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
    // Older files name the kind "type".
    let mut old = v4.clone();
    old["rope_scaling"]["type"] = old["rope_scaling"]["rope_type"].take();
    old["rope_scaling"].as_object_mut().unwrap().remove("rope_type");
    assert_eq!(parse(old).unwrap().rope_scaling, want);
    // transformers 5: rope_parameters holds the theta and the scaling.
    let mut v5 = tinyllama();
    for k in ["rope_theta", "rope_scaling", "torch_dtype"] {
        v5.as_object_mut().unwrap().remove(k);
    }
    v5["dtype"] = json!("bfloat16");
    v5["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let c = parse(v5).unwrap();
    assert_eq!((c.rope_theta, c.rope_scaling), (500000.0, want));
    let mut v5_default = tinyllama();
    v5_default.as_object_mut().unwrap().remove("rope_theta");
    v5_default["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1e6});
    assert_eq!(parse(v5_default).unwrap().rope_theta, 1e6);
}

/// The same rope parameters as transformers 4 (`rope_scaling` with `rope_type`, or `type`, and
/// top-level `rope_theta`) and transformers 5 (`rope_parameters`) write them.
fn rope_forms(theta: f64, params: Value) -> Vec<Value> {
    let mut v4 = tinyllama();
    v4["rope_theta"] = json!(theta);
    v4["rope_scaling"] = params.clone();
    let mut old = v4.clone();
    let kind = old["rope_scaling"].as_object_mut().unwrap().remove("rope_type").unwrap();
    old["rope_scaling"]["type"] = kind;
    let mut v5 = tinyllama();
    for k in ["rope_theta", "rope_scaling"] {
        v5.as_object_mut().unwrap().remove(k);
    }
    v5["rope_parameters"] = params;
    v5["rope_parameters"]["rope_theta"] = json!(theta);
    vec![v4, old, v5]
}

#[test]
fn linear_dynamic_and_yarn_read_in_both_config_forms() {
    let cases = [
        (json!({"rope_type": "linear", "factor": 4.0}), RopeScaling::Linear { factor: 4.0 }),
        // Dynamic NTK reads the config's max_position_embeddings (2048 in TinyLlama's).
        (
            json!({"rope_type": "dynamic", "factor": 2.0}),
            RopeScaling::Dynamic { factor: 2.0, max_position_embeddings: 2048.0 },
        ),
        (
            json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}),
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 512.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: true,
                attention_factor: 0.1 * 4f64.ln() + 1.0,
            },
        ),
        // Qwen3/DeepSeek style: every optional parameter given.
        (
            json!({"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707, "truncate": false}),
            RopeScaling::Yarn {
                factor: 40.0,
                original_max_position_embeddings: 4096.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: false,
                attention_factor: (0.1 * 40f64.ln() + 1.0) / (0.1 * 0.707 * 40f64.ln() + 1.0),
            },
        ),
        (
            json!({"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5, "beta_fast": 8, "beta_slow": 2}),
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 2048.0, // absent: max_position_embeddings
                beta_fast: 8.0,
                beta_slow: 2.0,
                truncate: true,
                attention_factor: 1.5,
            },
        ),
    ];
    for (params, want) in cases {
        for v in rope_forms(1e6, params.clone()) {
            let c = parse(v.clone()).unwrap_or_else(|e| panic!("{v}: {e}"));
            assert_eq!((c.rope_theta, c.rope_scaling), (1e6, want.clone()), "{v}");
        }
    }
    // YaRN's factor null: max_position_embeddings / original_max_position_embeddings.
    let mut v = tinyllama();
    v["max_position_embeddings"] = json!(32768);
    v["rope_scaling"] = json!({"rope_type": "yarn", "factor": null, "original_max_position_embeddings": 8192});
    assert!(matches!(parse(v).unwrap().rope_scaling, RopeScaling::Yarn { factor: 4.0, .. }));
    // A top-level original_max_position_embeddings wins over the parameters' (transformers'
    // standardize_rope_params), for yarn and llama3 alike.
    let mut v = tinyllama();
    v["original_max_position_embeddings"] = json!(1024);
    v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512});
    assert!(matches!(
        parse(v.clone()).unwrap().rope_scaling,
        RopeScaling::Yarn { original_max_position_embeddings: 1024.0, .. }
    ));
    v["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0});
    assert!(matches!(
        parse(v.clone()).unwrap().rope_scaling,
        RopeScaling::Llama3 { original_max_position_embeddings: 1024.0, .. }
    ));
    // ...but not for dynamic, which reads max_position_embeddings.
    v["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 2.0});
    assert!(matches!(parse(v).unwrap().rope_scaling, RopeScaling::Dynamic { max_position_embeddings: 2048.0, .. }));
    // Unknown kinds are refused by name in both forms.
    for v in rope_forms(1e4, json!({"rope_type": "proportional", "factor": 2.0})) {
        let e = parse(v).unwrap_err();
        assert!(matches!(&e, ModelError::Unsupported { value, .. } if value == "\"proportional\""), "{e}");
    }
    // longrope: one factor per pair of the head (32 for head_dim 64), in both forms.
    for v in rope_forms(1e4, json!({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]})) {
        let e = parse(v).unwrap_err();
        assert!(e.to_string().contains("short_factor has 1 entries; head_dim 64 needs 32"), "{e}");
    }
    let pairs = |f: f64| json!(vec![f; 32]);
    for v in rope_forms(1e4, json!({"rope_type": "longrope", "short_factor": pairs(1.5), "long_factor": pairs(3.0)})) {
        let c = parse(v).unwrap();
        // Phi-3's rule: factor = max_position_embeddings / original (2048 / 2048 here: 1, so the
        // attention factor is 1).
        assert!(
            matches!(&c.rope_scaling, RopeScaling::LongRope { attention_factor, short_factor, .. }
            if *attention_factor == 1.0 && short_factor.len() == 32),
            "{:?}",
            c.rope_scaling
        );
    }
    // Partial rotary: Phi-3's family rotates int(head_dim * factor) features; Llama's does not.
    let mut phi = tinyllama();
    phi["architectures"] = json!(["Phi3ForCausalLM"]);
    phi["partial_rotary_factor"] = json!(0.75);
    assert_eq!(parse(phi.clone()).unwrap().rotary_dim, 48);
    phi["partial_rotary_factor"] = json!(0.7); // int(44.8) = 44, as Python's int()
    assert_eq!(parse(phi.clone()).unwrap().rotary_dim, 44);
    phi["partial_rotary_factor"] = json!(0.52); // int(33.28) = 33: odd, no rotate-half
    let e = parse(phi).unwrap_err();
    assert!(matches!(&e, ModelError::ConfigField { field, .. } if field == "partial_rotary_factor"), "{e}");
    let mut llama = tinyllama();
    llama["partial_rotary_factor"] = json!(0.5);
    let e = parse(llama).unwrap_err();
    assert!(matches!(&e, ModelError::Unsupported { field, .. } if field == "partial_rotary_factor"), "{e}");
    // Bad parameters in the transformers 5 form are named with their prefix.
    let mut v = tinyllama();
    v.as_object_mut().unwrap().remove("rope_theta");
    v["rope_parameters"] = json!({"rope_type": "yarn", "rope_theta": 1e4, "factor": "four"});
    let e = parse(v).unwrap_err();
    assert!(matches!(&e, ModelError::ConfigField { field, .. } if field == "rope_parameters.factor"), "{e}");
}

#[test]
fn qwen2_and_mistral_take_their_architectures_rules() {
    let qwen = json!({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
        "sliding_window": 32768, "use_sliding_window": false, "max_window_layers": 21,
        "tie_word_embeddings": true, "hidden_act": "silu", "eos_token_id": 151643});
    let c = parse(qwen.clone()).unwrap();
    assert_eq!(c.architecture, Architecture::Qwen2);
    assert!(c.qkv_bias && !c.o_bias && !c.mlp_bias && c.tie_word_embeddings);
    assert_eq!((c.head_dim, c.sliding_window), (64, None));
    assert!(c.layer_types.iter().all(|&t| t == LayerType::Full));
    // use_sliding_window: the layers from max_window_layers on slide (transformers' rule), or
    // those layer_types names.
    let mut sliding = qwen;
    sliding["use_sliding_window"] = json!(true);
    let c = parse(sliding.clone()).unwrap();
    assert_eq!(c.sliding_window, Some(32768));
    assert_eq!(
        (0..24).map(|i| c.window_of(i).is_some()).collect::<Vec<_>>(),
        (0..24).map(|i| i >= 21).collect::<Vec<_>>()
    );
    let mut types: Vec<Value> =
        (0..24).map(|i| json!(if i % 2 == 0 { "sliding_attention" } else { "full_attention" })).collect();
    sliding["layer_types"] = json!(types.clone());
    assert_eq!(parse(sliding.clone()).unwrap().window_of(2), Some(32768));
    types.pop();
    sliding["layer_types"] = json!(types);
    assert!(parse(sliding).unwrap_err().to_string().contains("layer_types"));
    let mistral = json!({"architectures": ["MistralForCausalLM"], "hidden_size": 5120, "head_dim": 128,
        "intermediate_size": 14336, "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 131072, "sliding_window": 4096, "rope_theta": 1000000.0});
    let c = parse(mistral.clone()).unwrap();
    assert_eq!((c.head_dim, c.sliding_window), (128, Some(4096)));
    let mut no_window = mistral.clone();
    no_window["sliding_window"] = Value::Null;
    assert_eq!(parse(no_window).unwrap().sliding_window, None, "null: no window (Mistral 7B v0.2+)");
    let mut absent = mistral;
    absent.as_object_mut().unwrap().remove("sliding_window");
    assert_eq!(parse(absent).unwrap().sliding_window, Some(4096), "absent: transformers' default");
    let mut llama_bias = tinyllama();
    llama_bias["attention_bias"] = json!(true);
    llama_bias["mlp_bias"] = json!(true);
    let c = parse(llama_bias).unwrap();
    assert!(c.qkv_bias && c.o_bias && c.mlp_bias);
}

#[test]
fn bad_fields_are_named() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("architectures", json!(["BertModel"]), "BertModel"),
        ("architectures", json!([]), "architectures"),
        ("architectures", json!("LlamaForCausalLM"), "architectures"),
        ("hidden_size", json!(0), "hidden_size"),
        ("hidden_size", json!(-5), "hidden_size"),
        ("hidden_size", json!("2048"), "hidden_size"),
        ("num_attention_heads", json!(2.5), "num_attention_heads"),
        ("num_key_value_heads", json!(3), "num_key_value_heads"),
        ("vocab_size", Value::Null, "vocab_size"),
        ("rms_norm_eps", json!("tiny"), "rms_norm_eps"),
        ("rms_norm_eps", json!(-1.0), "rms_norm_eps"),
        ("tie_word_embeddings", json!("yes"), "tie_word_embeddings"),
        ("hidden_act", json!("gelu"), "gelu"),
        ("rope_scaling", json!({"rope_type": "longrope", "factor": 2.0}), "longrope"),
        ("rope_scaling", json!({"type": "su", "factor": 4.0}), "su"),
        ("rope_scaling", json!({"rope_type": "linear"}), "rope_scaling.factor"),
        ("rope_scaling", json!({"rope_type": "linear", "factor": "2"}), "rope_scaling.factor"),
        ("rope_scaling", json!({"rope_type": "dynamic", "factor": 0}), "rope_scaling.factor"),
        ("rope_scaling", json!({"rope_type": "yarn"}), "rope_scaling.factor"),
        ("rope_scaling", json!({"rope_type": "yarn", "factor": -4.0}), "rope_scaling.factor"),
        (
            "rope_scaling",
            json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}),
            "rope_scaling.original_max_position_embeddings",
        ),
        ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0, "beta_fast": "fast"}), "rope_scaling.beta_fast"),
        ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0, "mscale": [1]}), "rope_scaling.mscale"),
        (
            "rope_scaling",
            json!({"rope_type": "yarn", "factor": 4.0, "attention_factor": -1.0}),
            "rope_scaling.attention_factor",
        ),
        ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}), "rope_scaling.truncate"),
        ("original_max_position_embeddings", json!("4k"), "original_max_position_embeddings"),
        ("rope_scaling", json!({"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
        ("rope_scaling", json!(7), "rope_scaling"),
        ("rope_theta", json!(0), "rope_theta"),
        ("eos_token_id", json!("eos"), "eos_token_id"),
        ("head_dim", json!(63), "head_dim"),
        ("pad_token_id", json!(32000), "pad_token_id"),
        ("pad_token_id", json!(-32001), "pad_token_id"),
        ("pad_token_id", json!("<pad>"), "pad_token_id"),
    ];
    for (field, value, named) in cases {
        let mut c = tinyllama();
        c[field] = value.clone();
        if field == "original_max_position_embeddings" {
            c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        }
        let e = parse(c).expect_err(&format!("{field} = {value}"));
        assert!(e.to_string().contains(named), "{field} = {value}: {e}");
    }
    for field in ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"] {
        let mut c = tinyllama();
        c.as_object_mut().unwrap().remove(field);
        let e = parse(c).unwrap_err();
        assert!(matches!(&e, ModelError::ConfigField { field: f, .. } if f == field), "{e}");
    }
    // head_dim absent and hidden not divisible by the heads.
    let mut c = tinyllama();
    c["hidden_size"] = json!(2050);
    assert!(parse(c).unwrap_err().to_string().contains("head_dim"));
    // No architectures: model_type decides; unknown model_type is named.
    let mut c = tinyllama();
    c.as_object_mut().unwrap().remove("architectures");
    assert_eq!(parse(c.clone()).unwrap().architecture, Architecture::Llama);
    c["model_type"] = json!("gpt2");
    assert!(matches!(parse(c), Err(ModelError::UnknownArchitecture { name, .. }) if name == "gpt2"));
}

#[test]
fn family_rules_of_the_transformers_config_classes() {
    let base = |arch: &str| {
        let mut c = tinyllama();
        c["architectures"] = json!([arch]);
        c.as_object_mut().unwrap().remove("num_key_value_heads");
        c
    };
    // num_key_value_heads absent: each class's own default (Qwen 32, Mistral 8, Gemma 3 4;
    // Llama, Phi-3 and OLMo 2 the attention heads).
    for (arch, kv) in [
        ("Qwen3ForCausalLM", 32),
        ("Qwen2ForCausalLM", 32),
        ("MistralForCausalLM", 8),
        ("Gemma3ForCausalLM", 4),
        ("LlamaForCausalLM", 32),
        ("Phi3ForCausalLM", 32),
        ("Olmo2ForCausalLM", 32),
    ] {
        assert_eq!(parse(base(arch)).unwrap().num_key_value_heads, kv, "{arch}");
    }
    // Gemma 3 ignores attn_logit_softcapping as transformers and vLLM do: the config is the
    // same with it; a value that is not a number is still refused.
    let mut capped = base("Gemma3ForCausalLM");
    capped["attn_logit_softcapping"] = json!(50.0);
    assert_eq!(parse(capped.clone()).unwrap(), parse(base("Gemma3ForCausalLM")).unwrap());
    capped["attn_logit_softcapping"] = json!("high");
    assert!(parse(capped).unwrap_err().to_string().contains("attn_logit_softcapping"));
    // Gemma 3's MLP reads hidden_activation alone: a hidden_act beside it changes nothing.
    let mut gemma = base("Gemma3ForCausalLM");
    gemma["hidden_act"] = json!("silu");
    gemma.as_object_mut().unwrap().remove("hidden_activation");
    assert_eq!(parse(gemma.clone()).unwrap().hidden_act, tp_core::Activation::GeluTanh);
    // Gemma 3's nested rope parameters without a base: rope_theta (global) and
    // rope_local_base_freq (sliding), as Gemma3TextConfig standardises them.
    gemma["rope_theta"] = json!(1e6);
    gemma["rope_local_base_freq"] = json!(5000.0);
    gemma["rope_parameters"] = json!({"full_attention": {"rope_type": "default"},
        "sliding_attention": {"rope_type": "default"}});
    let c = parse(gemma.clone()).unwrap();
    assert_eq!((c.rope_theta, c.local_rope.clone().map(|l| l.0)), (1e6, Some(5000.0)));
    // A flat rope_parameters is not per layer type: default rope on both, as transformers.
    gemma["rope_parameters"] = json!({"rope_type": "linear", "factor": 8.0});
    let c = parse(gemma.clone()).unwrap();
    assert_eq!((c.rope_scaling, c.local_rope.map(|l| l.1)), (RopeScaling::Default, Some(RopeScaling::Default)));
    // The attention scale must be a positive f32.
    gemma["query_pre_attn_scalar"] = json!(1e300);
    assert!(parse(gemma).unwrap_err().to_string().contains("query_pre_attn_scalar"));
    // Phi-3's config reads "yarn" (and "su") as longrope; Llama's reads yarn as yarn.
    let mut phi = base("Phi3ForCausalLM");
    phi["rope_scaling"] = json!({"type": "yarn", "factor": 2.0,
        "short_factor": vec![1.0; 32], "long_factor": vec![2.0; 32]});
    assert!(matches!(parse(phi).unwrap().rope_scaling, RopeScaling::LongRope { .. }));
    let mut llama = base("LlamaForCausalLM");
    llama["rope_scaling"] = json!({"type": "yarn", "factor": 2.0});
    assert!(matches!(parse(llama).unwrap().rope_scaling, RopeScaling::Yarn { .. }));
}

/// Mixture-of-experts fields: the classes' defaults fill what is absent; a top-k above the
/// expert count, a zero sparse step or a malformed `mlp_only_layers` is refused by name.
#[test]
fn moe_fields_read_with_the_classes_defaults_and_bad_ones_are_named() {
    let qwen3 = || {
        let mut c = tinyllama();
        c["architectures"] = json!(["Qwen3MoeForCausalLM"]);
        c
    };
    let m = parse(qwen3()).unwrap().moe.unwrap();
    assert_eq!((m.num_experts, m.top_k, m.expert_intermediate_size), (128, 8, 768));
    assert!(!m.norm_topk_prob && !m.output_router_logits && m.sparse_layers.iter().all(|&s| s));
    let mut c = qwen3();
    c["decoder_sparse_step"] = json!(2);
    c["mlp_only_layers"] = json!([1]);
    let m = parse(c).unwrap().moe.unwrap();
    assert_eq!(&m.sparse_layers[..4], &[false, false, false, true]);
    let mut mixtral = tinyllama();
    mixtral["architectures"] = json!(["MixtralForCausalLM"]);
    let m = parse(mixtral).unwrap().moe.unwrap();
    assert_eq!((m.num_experts, m.top_k, m.expert_intermediate_size, m.norm_topk_prob), (8, 2, 5632, true));
    for (field, value, named) in [
        ("num_experts_per_tok", json!(200), "num_experts_per_tok"),
        ("decoder_sparse_step", json!(0), "decoder_sparse_step"),
        ("mlp_only_layers", json!("all"), "mlp_only_layers"),
        ("num_experts", json!(-1), "num_experts"),
    ] {
        let mut c = qwen3();
        c[field] = value.clone();
        let e = parse(c).expect_err(&format!("{field} = {value}"));
        assert!(e.to_string().contains(named), "{field} = {value}: {e}");
    }
}

/// gpt-oss-20b's config.json in the form the Hub serves it (transformers 4 form: `rope_scaling`
/// with `rope_theta` beside it, `quantization_config` for its MXFP4 experts, `experts_per_token`
/// and `initial_context_length` keys transformers does not read), and the defaults of
/// `GptOssConfig` when those keys are absent.
#[test]
fn gpt_oss_configs_read_as_transformers_reads_them() {
    let layer_types: Vec<&str> =
        (0..24).map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect();
    let hub = json!({
        "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": layer_types, "max_position_embeddings": 131072,
        "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
        "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
            "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
            "rope_type": "yarn", "truncate": false},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": false, "use_cache": true, "vocab_size": 201088
    });
    let c = parse(hub.clone()).unwrap();
    assert_eq!(c.architecture, Architecture::GptOss);
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (64, 8, 64));
    assert_eq!((c.qkv_bias, c.o_bias, c.mlp_bias), (true, true, false));
    assert_eq!(c.sliding_window, Some(128));
    assert_eq!(c.window_of(0), Some(128));
    assert_eq!(c.window_of(1), None);
    assert_eq!(c.rope_theta, 150000.0);
    let RopeScaling::Yarn { factor, original_max_position_embeddings, truncate, .. } = c.rope_scaling else {
        panic!("{:?}", c.rope_scaling)
    };
    assert_eq!((factor, original_max_position_embeddings, truncate), (32.0, 4096.0, false));
    let moe = c.moe.as_ref().unwrap();
    assert_eq!((moe.num_experts, moe.top_k, moe.expert_intermediate_size), (32, 4, 2880));
    assert!(moe.norm_topk_prob && moe.sparse_layers.iter().all(|&s| s));
    assert_eq!(moe.router_aux_loss_coef, 0.9);
    assert_eq!(moe.activation, Some(tp_core::Activation::ClampedSwiglu { alpha: 1.702, limit: 7.0 }));
    // The class's defaults: attention biases on, a window of 128 on the even layers, YaRN.
    let mut bare = hub;
    for key in ["attention_bias", "layer_types", "sliding_window", "rope_scaling", "rope_theta", "swiglu_limit"] {
        bare.as_object_mut().unwrap().remove(key);
    }
    let d = parse(bare).unwrap();
    assert_eq!((d.qkv_bias, d.o_bias, d.sliding_window, d.rope_theta), (true, true, Some(128), 150000.0));
    assert_eq!((d.window_of(2), d.window_of(3)), (Some(128), None));
    assert!(matches!(d.rope_scaling, RopeScaling::Yarn { factor: 32.0, truncate: false, .. }), "{:?}", d.rope_scaling);
    assert_eq!(d, c, "the Hub's config spells out the class's defaults");
    // A clamp or gain that is not a positive number is refused by name.
    for key in ["swiglu_limit", "swiglu_alpha"] {
        let e = parse(gpt_oss_with(key, json!(-1.0))).unwrap_err().to_string();
        assert!(e.contains(key), "{e}");
    }
    assert!(parse(gpt_oss_with("swiglu_limit", json!(1.5))).is_ok());
}

/// A small gpt-oss config with `key` set to `v`.
fn gpt_oss_with(key: &str, v: Value) -> Value {
    let mut base = json!({
        "architectures": ["GptOssForCausalLM"], "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 100, "num_local_experts": 4,
        "num_experts_per_tok": 2
    });
    base[key] = v;
    base
}
