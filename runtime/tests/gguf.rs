//! The GGUF reader on hand-built files: every element type dequantizes to the values its block
//! layout defines, metadata of every type reads back, every class of malformed file gives its own
//! error (and no input panics), and a checkpoint in llama.cpp's layout loads through the weight
//! map to the same logits as the transformers checkpoint it was made from.

use half::{bf16, f16};
use kiln_compiler::tensor::Tensor;
use kiln_runtime::gguf::{Array, GgmlType, Gguf, GgufError, Value};
use kiln_runtime::{Checkpoint, WeightError};
use std::path::{Path, PathBuf};

mod support;
use support::{ARRAY, Builder, STRING, U32, string};

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn tensor(g: &Gguf, name: &str) -> Tensor {
    g.tensor(name).expect("tensor exists").unwrap_or_else(|e| panic!("{e}"))
}

fn parse_err(b: &Builder) -> GgufError {
    match b.parse() {
        Ok(_) => panic!("the file should be rejected"),
        Err(e) => e,
    }
}

// ---------------------------------------------------------------------------------------------
// Element types

#[test]
fn plain_types_convert_with_dimensions_reversed() {
    let v = [1.5f32, -2.0, 0.25, 3.0, -0.5, 7.0];
    let g = Builder::new()
        .tensor("f32", &[3, 2], GgmlType::F32, &f32_bytes(&v))
        .tensor(
            "f16",
            &[3, 2],
            GgmlType::F16,
            &v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect::<Vec<_>>(),
        )
        .tensor(
            "bf16",
            &[3, 2],
            GgmlType::BF16,
            &v.iter().flat_map(|&x| bf16::from_f32(x).to_le_bytes()).collect::<Vec<_>>(),
        )
        .tensor("f64", &[3, 2], GgmlType::F64, &v.iter().flat_map(|&x| f64::from(x).to_le_bytes()).collect::<Vec<_>>())
        .tensor("i8", &[3], GgmlType::I8, &[0xff, 5, 0x80])
        .tensor("i16", &[2], GgmlType::I16, &[(-300i16).to_le_bytes(), 7i16.to_le_bytes()].concat())
        .tensor("i32", &[2], GgmlType::I32, &[(-70000i32).to_le_bytes(), 9i32.to_le_bytes()].concat())
        .tensor("i64", &[1], GgmlType::I64, &(-1i64 << 40).to_le_bytes())
        .parse()
        .unwrap();
    // GGUF dims [3, 2] (fastest first) are two rows of three.
    for name in ["f32", "f16", "bf16", "f64"] {
        assert_eq!(tensor(&g, name), Tensor::f32(vec![2, 3], v.to_vec()), "{name}");
    }
    assert_eq!(g.info("f32").unwrap().dims(), &[3, 2]);
    assert_eq!(g.info("f32").unwrap().shape(), &[2, 3]);
    assert_eq!(tensor(&g, "i8"), Tensor::i64(vec![3], vec![-1, 5, -128]));
    assert_eq!(tensor(&g, "i16"), Tensor::i64(vec![2], vec![-300, 7]));
    assert_eq!(tensor(&g, "i32"), Tensor::i64(vec![2], vec![-70000, 9]));
    assert_eq!(tensor(&g, "i64"), Tensor::i64(vec![1], vec![-1 << 40]));
}

/// Two Q8_0 blocks: an f16 scale, then 32 signed bytes; `x = q * d`.
#[test]
fn q8_0_dequantizes_each_block_with_its_scale() {
    let mut data = Vec::new();
    let mut expected = Vec::new();
    for (d, base) in [(0.5f32, -16i32), (-0.125, 100)] {
        data.extend(f16::from_f32(d).to_le_bytes());
        for k in 0..32 {
            let q = (base + 3 * k).clamp(-128, 127) as i8;
            data.push(q as u8);
            expected.push(f32::from(q) * d);
        }
    }
    let g = Builder::new().tensor("w", &[32, 2], GgmlType::Q8_0, &data).parse().unwrap();
    assert_eq!(tensor(&g, "w"), Tensor::f32(vec![2, 32], expected));
    let raw = g.raw("w").unwrap().unwrap();
    assert_eq!((raw.info.ty(), raw.bytes), (GgmlType::Q8_0, &data[..]));
}

/// Q4_0 and Q4_1 blocks of 32: 16 bytes whose low nibbles are elements 0..16 and whose high
/// nibbles are elements 16..32. Q4_0: `x = (q - 8) * d`; Q4_1: `x = q * d + m`.
#[test]
fn q4_0_and_q4_1_dequantize_low_nibbles_first() {
    // Nibble values: element j < 16 is j, element 16 + j is 15 - j.
    let nibbles: Vec<u8> = (0..16u8).map(|j| j | ((15 - j) << 4)).collect();
    let q: Vec<f32> = (0..16).chain((0..16).map(|j| 15 - j)).map(|v| v as f32).collect();

    let (d0, d1) = (0.25f32, 2.0f32);
    let mut q4_0 = Vec::new();
    for d in [d0, d1] {
        q4_0.extend(f16::from_f32(d).to_le_bytes());
        q4_0.extend_from_slice(&nibbles);
    }
    let expected_0: Vec<f32> = [d0, d1].iter().flat_map(|&d| q.iter().map(move |&v| (v - 8.0) * d)).collect();

    let (m0, m1) = (-1.0f32, 0.5f32);
    let mut q4_1 = Vec::new();
    for (d, m) in [(d0, m0), (d1, m1)] {
        q4_1.extend(f16::from_f32(d).to_le_bytes());
        q4_1.extend(f16::from_f32(m).to_le_bytes());
        q4_1.extend_from_slice(&nibbles);
    }
    let expected_1: Vec<f32> =
        [(d0, m0), (d1, m1)].iter().flat_map(|&(d, m)| q.iter().map(move |&v| v * d + m)).collect();

    let g = Builder::new()
        .tensor("q4_0", &[64], GgmlType::Q4_0, &q4_0)
        .tensor("q4_1", &[32, 2], GgmlType::Q4_1, &q4_1)
        .parse()
        .unwrap();
    assert_eq!(tensor(&g, "q4_0"), Tensor::f32(vec![64], expected_0));
    assert_eq!(tensor(&g, "q4_1"), Tensor::f32(vec![2, 32], expected_1));
}

/// Q5_0 blocks of 32: an f16 scale, a `u32` whose bit `j` is element `j`'s fifth bit, then
/// nibbles as in Q4_0; `x = (q - 16) * d`.
#[test]
fn q5_0_dequantizes_with_the_fifth_bits() {
    // Element j of block b is (5j + 3b) mod 32: every 5-bit value, the high bit in both halves.
    let q = |b: usize, j: usize| ((5 * j + 3 * b) % 32) as u8;
    let mut data = Vec::new();
    let mut expected = Vec::new();
    for (b, d) in [0.5f32, -0.0625].into_iter().enumerate() {
        data.extend(f16::from_f32(d).to_le_bytes());
        let qh = (0..32).fold(0u32, |h, j| h | (u32::from(q(b, j) >> 4) << j));
        data.extend(qh.to_le_bytes());
        data.extend((0..16).map(|j| (q(b, j) & 0x0f) | ((q(b, j + 16) & 0x0f) << 4)));
        expected.extend((0..32).map(|j| (f32::from(q(b, j)) - 16.0) * d));
    }
    let g = Builder::new().tensor("w", &[32, 2], GgmlType::Q5_0, &data).parse().unwrap();
    assert_eq!(tensor(&g, "w"), Tensor::f32(vec![2, 32], expected));
}

/// Packs Q4_K's eight 6-bit scales and minimums into 12 bytes: bytes 0-3 hold scales 0-3 in
/// their low 6 bits and the top 2 bits of scales 4-7 above; bytes 4-7 the same for the minimums;
/// bytes 8-11 the low nibbles of scale 4 + i (low) and minimum 4 + i (high).
fn pack_q4_k_scales(scales: [u8; 8], mins: [u8; 8]) -> [u8; 12] {
    let mut out = [0u8; 12];
    for i in 0..4 {
        out[i] = scales[i] | ((scales[i + 4] >> 4) << 6);
        out[i + 4] = mins[i] | ((mins[i + 4] >> 4) << 6);
        out[i + 8] = (scales[i + 4] & 0x0f) | ((mins[i + 4] & 0x0f) << 4);
    }
    out
}

/// A Q4_K super-block of 256: f16 `d` and `dmin`, packed 6-bit scales and minimums per
/// sub-block of 32, then nibbles (sub-blocks `2c`, `2c + 1` in the low and high nibbles of bytes
/// `32c..32c + 32`); `x = d * scale * q - dmin * min`.
#[test]
fn q4_k_dequantizes_with_six_bit_scales_and_minimums() {
    // Scales and minimums across the whole 6-bit range, so their top bits are exercised.
    let scales: [u8; 8] = std::array::from_fn(|j| 7 * j as u8 + 13);
    let mins: [u8; 8] = std::array::from_fn(|j| 63 - 8 * j as u8);
    let q = |s: usize, i: usize| ((i + 3 * s) % 16) as u8;
    let (d, dmin) = (0.5f32, 0.25f32);
    let mut data = Vec::new();
    data.extend(f16::from_f32(d).to_le_bytes());
    data.extend(f16::from_f32(dmin).to_le_bytes());
    data.extend(pack_q4_k_scales(scales, mins));
    for c in 0..4 {
        data.extend((0..32).map(|i| q(2 * c, i) | (q(2 * c + 1, i) << 4)));
    }
    assert_eq!(data.len(), 144);
    let expected: Vec<f32> = (0..256)
        .map(|e| {
            let (s, i) = (e / 32, e % 32);
            d * f32::from(scales[s]) * f32::from(q(s, i)) - dmin * f32::from(mins[s])
        })
        .collect();
    let g = Builder::new().tensor("w", &[256], GgmlType::Q4_K, &data).parse().unwrap();
    assert_eq!(tensor(&g, "w"), Tensor::f32(vec![256], expected));
}

/// A Q6_K super-block of 256: low nibbles `ql`, high bit pairs `qh`, a signed scale per 16
/// elements, then f16 `d`; in each half of 128, element `32c + l` has its low bits in nibble
/// `c / 2` of `ql[32 (c % 2) + l]` and its high bits at `2c` of `qh[l]`; `x = d * scale * (q - 32)`.
#[test]
fn q6_k_dequantizes_with_signed_scales() {
    let q = |e: usize| ((7 * e + e / 64) % 64) as u8;
    let scales: [i8; 16] = std::array::from_fn(|i| (i as i8 - 8) * 15);
    let d = 0.125f32;
    let (mut ql, mut qh) = (vec![0u8; 128], vec![0u8; 64]);
    for e in 0..256 {
        let (half, c, l) = (e / 128, e % 128 / 32, e % 32);
        ql[64 * half + 32 * (c % 2) + l] |= (q(e) & 0x0f) << (4 * (c / 2));
        qh[32 * half + l] |= (q(e) >> 4) << (2 * c);
    }
    let mut data = [ql, qh].concat();
    data.extend(scales.iter().map(|&s| s as u8));
    data.extend(f16::from_f32(d).to_le_bytes());
    assert_eq!(data.len(), 210);
    let expected: Vec<f32> = (0..256).map(|e| d * f32::from(scales[e / 16]) * (f32::from(q(e)) - 32.0)).collect();
    let g = Builder::new().tensor("w", &[256], GgmlType::Q6_K, &data).parse().unwrap();
    assert_eq!(tensor(&g, "w"), Tensor::f32(vec![256], expected));
}

/// Real blocks (cut from Gemma 3 270M's Q4_K_M GGUF) and random ones of each type dequantize
/// bit for bit to what gguf-py's `gguf.quants.dequantize` gave (`scripts/quant-fixture` wrote
/// both into `fixtures/quants.gguf`).
#[test]
fn quantized_blocks_dequantize_like_gguf_py() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quants.gguf");
    let g = Gguf::parse(std::fs::read(&path).unwrap()).unwrap();
    for ty in ["Q5_0", "Q4_K", "Q6_K"] {
        for part in ["real", "random"] {
            let name = format!("{ty}.{part}");
            assert_eq!(g.info(&name).unwrap().ty().name(), Some(ty));
            let (got, want) = (tensor(&g, &name), tensor(&g, &format!("{name}.expected")));
            assert_eq!(got.shape, want.shape, "{name}");
            let bits = |t: &Tensor| t.as_f32().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{name}");
        }
    }
}

/// A K-quantized tensor whose rows are not whole super-blocks of 256, or whose data the file
/// cannot hold, is refused by name when the file is parsed.
#[test]
fn k_quant_rows_and_lengths_are_checked() {
    let e = parse_err(&Builder::new().tensor("ffn", &[640, 1], GgmlType::Q4_K, &[0; 144 * 3]));
    assert_eq!(
        e,
        GgufError::NotBlockMultiple {
            tensor: "ffn".into(),
            ty: GgmlType::Q4_K,
            block: 256,
            row: 640,
            dims: vec![640, 1]
        }
    );
    assert!(e.to_string().contains("Q4_K"), "{e}");
    // Two super-blocks declared, one stored: the data runs past the end of the file.
    let e = parse_err(&Builder::new().tensor("down", &[256, 2], GgmlType::Q6_K, &[0; 210]));
    assert!(matches!(&e, GgufError::DataOutOfRange { tensor, size: 420, .. } if tensor == "down"), "{e:?}");
    let e = parse_err(&Builder::new().tensor("q", &[48], GgmlType::Q5_0, &[0; 44]));
    assert!(matches!(&e, GgufError::NotBlockMultiple { block: 32, row: 48, .. }), "{e:?}");
}

#[test]
fn unsupported_types_are_named_when_read() {
    let g = Builder::new()
        .tensor("k", &[256], GgmlType(13), &[0; 176])
        .info("iq", &[256], 16, 0)
        .info("odd", &[4], 99, 0)
        .parse()
        .unwrap();
    assert_eq!(g.info("k").unwrap().ty().name(), Some("Q5_K"));
    // Q5_K's block size is known: its raw bytes can be read, but not converted.
    assert_eq!(g.raw("k").unwrap().unwrap().bytes.len(), 176);
    let e = g.tensor("k").unwrap().unwrap_err();
    assert!(matches!(&e, GgufError::UnsupportedType { ty, action: "convert", .. } if *ty == GgmlType(13)), "{e:?}");
    assert!(e.to_string().contains("type Q5_K"), "{e}");
    let e = g.tensor("iq").unwrap().unwrap_err();
    assert!(matches!(e, GgufError::UnsupportedType { action: "read", .. }), "{e:?}");
    assert!(e.to_string().contains("IQ2_XXS"), "{e}");
    assert!(g.tensor("odd").unwrap().unwrap_err().to_string().contains("unknown type 99"));
    assert!(g.tensor("absent").is_none());
}

// ---------------------------------------------------------------------------------------------
// Metadata

#[test]
fn metadata_of_every_type_reads_back() {
    let strings = ["<s>", "héllo", ""];
    let mut str_array = STRING.to_le_bytes().to_vec();
    str_array.extend((strings.len() as u64).to_le_bytes());
    for s in strings {
        str_array.extend(string(s));
    }
    let mut nested = ARRAY.to_le_bytes().to_vec();
    nested.extend(2u64.to_le_bytes());
    for row in [[1i32, 2], [3, 4]] {
        nested.extend(5u32.to_le_bytes());
        nested.extend(2u64.to_le_bytes());
        nested.extend(row.iter().flat_map(|v| v.to_le_bytes()));
    }
    let g = Builder::new()
        .kv("u8", 0, &[200])
        .kv("i8", 1, &[0xfe])
        .kv("u16", 2, &60000u16.to_le_bytes())
        .kv("i16", 3, &(-2i16).to_le_bytes())
        .kv("u32", 4, &4_000_000_000u32.to_le_bytes())
        .kv("i32", 5, &(-5i32).to_le_bytes())
        .kv("f32", 6, &1.5f32.to_le_bytes())
        .kv("bool", 7, &[1])
        .kv_str("str", "llama")
        .kv("strs", ARRAY, &str_array)
        .kv("u64", 10, &(1u64 << 40).to_le_bytes())
        .kv("i64", 11, &(-7i64).to_le_bytes())
        .kv("f64", 12, &0.125f64.to_le_bytes())
        .kv("nested", ARRAY, &nested)
        .parse()
        .unwrap();
    assert_eq!(g.get("u8"), Some(&Value::U8(200)));
    assert_eq!(g.get("i8"), Some(&Value::I8(-2)));
    assert_eq!(g.get("u16"), Some(&Value::U16(60000)));
    assert_eq!(g.get("i16"), Some(&Value::I16(-2)));
    assert_eq!(g.get_u32("u32"), Some(4_000_000_000));
    assert_eq!(g.get("i32"), Some(&Value::I32(-5)));
    assert_eq!(g.get_f64("f32"), Some(1.5));
    assert_eq!(g.get_bool("bool"), Some(true));
    assert_eq!(g.get_str("str"), Some("llama"));
    assert_eq!(g.get_array_str("strs"), Some(&strings.map(String::from)[..]));
    assert_eq!(g.get_u64("u64"), Some(1 << 40));
    assert_eq!(g.get_u32("u64"), None, "does not fit");
    assert_eq!(g.get_u64("i64"), None, "negative");
    assert_eq!(g.get("i64").and_then(Value::as_i64), Some(-7));
    assert_eq!(g.get_f64("f64"), Some(0.125));
    assert_eq!(g.get_array("nested"), Some(&Array::Array(vec![Array::I32(vec![1, 2]), Array::I32(vec![3, 4])])));
    assert_eq!(g.metadata().len(), 14);
    assert_eq!(g.alignment(), 32);
}

#[test]
fn a_custom_alignment_places_the_data() {
    let b = Builder::new().alignment(64).tensor("a", &[2], GgmlType::F32, &f32_bytes(&[1.0, 2.0])).tensor(
        "b",
        &[1],
        GgmlType::F32,
        &f32_bytes(&[3.0]),
    );
    let g = b.parse().unwrap();
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.data_start() % 64, 0);
    assert_eq!(g.info("b").unwrap().offset(), 64);
    assert_eq!(tensor(&g, "b"), Tensor::f32(vec![1], vec![3.0]));
}

#[test]
fn version_2_is_read() {
    let mut b = Builder::new().kv_str("general.architecture", "llama");
    b.version = 2;
    assert_eq!(b.parse().unwrap().version(), 2);
}

// ---------------------------------------------------------------------------------------------
// Malformed files

fn small_file() -> Builder {
    Builder::new()
        .kv_str("general.architecture", "llama")
        .kv("tokenizer.ggml.bos_token_id", U32, &1u32.to_le_bytes())
        .tensor("token_embd.weight", &[4, 2], GgmlType::F32, &f32_bytes(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]))
        .tensor("output_norm.weight", &[32], GgmlType::Q8_0, &[0; 34])
}

#[test]
fn bad_magic_and_versions() {
    let mut bytes = small_file().bytes();
    bytes[3] = b'X';
    assert_eq!(Gguf::parse(bytes).unwrap_err(), GgufError::BadMagic { found: b"GGUX".to_vec() });
    assert_eq!(Gguf::parse(Vec::new()).unwrap_err(), GgufError::BadMagic { found: Vec::new() });
    for version in [1, 4] {
        let mut b = small_file();
        b.version = version;
        assert_eq!(parse_err(&b), GgufError::UnsupportedVersion { version });
    }
}

#[test]
fn truncation_is_reported_with_the_field_and_offset() {
    let bytes = small_file().bytes();
    let e = Gguf::parse(bytes[..12].to_vec()).unwrap_err();
    assert_eq!(e, GgufError::Truncated { what: "tensor count".into(), offset: 8, needed: 8, len: 12 });
    assert_eq!(e.to_string(), "truncated file: tensor count at byte 8 needs 8 bytes, but the file ends at byte 12");
    // The first pair: key length at 24, 20 bytes of key at 32, value type at 52, the value's
    // string length at 56.
    let e = Gguf::parse(bytes[..60].to_vec()).unwrap_err();
    let what = "metadata `general.architecture`".to_string();
    assert_eq!(e, GgufError::Truncated { what, offset: 56, needed: 8, len: 60 });
    // Every proper prefix is an error, never a panic.
    for n in 0..bytes.len() {
        assert!(Gguf::parse(bytes[..n].to_vec()).is_err(), "prefix of {n} bytes");
    }
    // Cutting into the data section names the tensor.
    let e = Gguf::parse(bytes[..bytes.len() - 1].to_vec()).unwrap_err();
    assert!(matches!(&e, GgufError::DataOutOfRange { tensor, .. } if tensor == "output_norm.weight"), "{e:?}");
}

#[test]
fn no_corrupted_byte_panics() {
    let bytes = small_file().bytes();
    for i in 0..bytes.len() {
        for value in [0x00, 0x01, 0x7f, 0xff] {
            let mut b = bytes.clone();
            b[i] = value;
            if let Ok(g) = Gguf::parse(b) {
                for t in g.tensors() {
                    let _ = g.tensor(t.name());
                }
            }
        }
    }
}

/// Overwrites 8 bytes at `at` with `value`.
fn patched(mut bytes: Vec<u8>, at: usize, value: u64) -> Vec<u8> {
    bytes[at..at + 8].copy_from_slice(&value.to_le_bytes());
    bytes
}

#[test]
fn huge_counts_and_lengths_are_rejected_before_allocating() {
    let bytes = small_file().bytes();
    let huge = 1u64 << 60;
    let e = Gguf::parse(patched(bytes.clone(), 8, huge)).unwrap_err();
    assert!(
        matches!(&e, GgufError::TooLarge { what, offset: 8, count, .. } if what == "tensor count" && *count == huge),
        "{e:?}"
    );
    let e = Gguf::parse(patched(bytes.clone(), 16, huge)).unwrap_err();
    assert!(matches!(&e, GgufError::TooLarge { what, offset: 16, .. } if what == "metadata count"), "{e:?}");
    let e = Gguf::parse(patched(bytes.clone(), 16, u64::MAX)).unwrap_err();
    assert!(matches!(e, GgufError::TooLarge { .. }), "{e:?}");
    // The first key's length.
    let e = Gguf::parse(patched(bytes, 24, huge)).unwrap_err();
    assert!(matches!(&e, GgufError::Truncated { offset: 32, needed, .. } if *needed == huge), "{e:?}");
    // An array's element count.
    let mut payload = 4u32.to_le_bytes().to_vec();
    payload.extend(huge.to_le_bytes());
    let e = parse_err(&Builder::new().kv("tokenizer.ggml.token_type", ARRAY, &payload));
    assert!(matches!(&e, GgufError::TooLarge { count, min_size: 4, .. } if *count == huge), "{e:?}");
    let mut payload = STRING.to_le_bytes().to_vec();
    payload.extend(huge.to_le_bytes());
    let e = parse_err(&Builder::new().kv("tokenizer.ggml.tokens", ARRAY, &payload));
    assert!(matches!(&e, GgufError::TooLarge { what, min_size: 8, .. } if what == "metadata `tokenizer.ggml.tokens`"));
}

#[test]
fn tensor_data_outside_the_file_is_rejected() {
    let e = parse_err(&small_file().info("late", &[8], GgmlType::F32.0, 1 << 20));
    assert!(
        matches!(&e, GgufError::DataOutOfRange { tensor, offset, size: 32, .. } if tensor == "late" && *offset == 1 << 20)
    );
    // An offset near u64::MAX overflows instead of wrapping around.
    let e = parse_err(&small_file().info("wrap", &[8], GgmlType::F32.0, u64::MAX - 31));
    assert!(matches!(e, GgufError::DataOutOfRange { .. }), "{e:?}");
    let e = parse_err(&small_file().info("odd", &[8], GgmlType::F32.0, 4));
    assert_eq!(e, GgufError::Misaligned { tensor: "odd".into(), offset: 4, alignment: 32 });
}

#[test]
fn bad_dimensions_are_rejected() {
    let e = parse_err(&Builder::new().info("big", &[1 << 32, 1 << 32, 1 << 32], GgmlType::F32.0, 0));
    assert!(matches!(&e, GgufError::DimsOverflow { tensor, .. } if tensor == "big"), "{e:?}");
    // The element count fits, its byte size does not.
    let e = parse_err(&Builder::new().info("bytes", &[1 << 62], GgmlType::F32.0, 0));
    assert!(matches!(e, GgufError::DimsOverflow { .. }), "{e:?}");
    let e = parse_err(&Builder::new().info("q", &[31, 2], GgmlType::Q8_0.0, 0));
    assert_eq!(
        e,
        GgufError::NotBlockMultiple { tensor: "q".into(), ty: GgmlType::Q8_0, block: 32, row: 31, dims: vec![31, 2] }
    );
    assert!(e.to_string().contains("whose blocks hold 32 elements, but its rows have 31"), "{e}");
    let e = parse_err(&Builder::new().info("t", &[1, 1, 1, 1, 1], GgmlType::F32.0, 0));
    assert_eq!(e, GgufError::TooManyDims { tensor: "t".into(), n_dims: 5 });
}

#[test]
fn bad_metadata_is_rejected() {
    let e = parse_err(&Builder::new().kv("general.name", 13, &[0; 8]));
    assert!(matches!(&e, GgufError::UnknownValueType { what, type_id: 13, .. } if what == "metadata `general.name`"));
    let e = parse_err(&Builder::new().kv("flag", 7, &[2]));
    assert!(matches!(e, GgufError::InvalidBool { byte: 2, .. }), "{e:?}");
    let e = parse_err(&Builder::new().kv("s", STRING, &[2u64.to_le_bytes().as_slice(), &[0xff, 0xfe]].concat()));
    assert!(matches!(&e, GgufError::InvalidUtf8 { what, .. } if what == "metadata `s`"), "{e:?}");
    let e = parse_err(&Builder::new().kv_str("k", "a").kv_str("k", "b"));
    assert_eq!(e, GgufError::DuplicateKey { key: "k".into() });
    let e = parse_err(&Builder::new().alignment(13));
    assert!(matches!(e, GgufError::BadAlignment { .. }), "{e:?}");
    let e = parse_err(&Builder::new().kv_str("general.alignment", "32"));
    assert!(matches!(e, GgufError::BadAlignment { .. }), "{e:?}");
    let e = parse_err(&small_file().tensor("token_embd.weight", &[1], GgmlType::F32, &[0; 4]));
    assert_eq!(e, GgufError::DuplicateTensor { name: "token_embd.weight".into() });
    // Arrays nested past the bound, each level an (array type, count 1) header.
    let mut deep = Vec::new();
    for _ in 0..100 {
        deep.extend(ARRAY.to_le_bytes());
        deep.extend(1u64.to_le_bytes());
    }
    let e = parse_err(&Builder::new().kv("deep", ARRAY, &deep));
    assert_eq!(e, GgufError::NestingTooDeep { key: "deep".into() });
}

// ---------------------------------------------------------------------------------------------
// Checkpoints

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-gguf-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(path: &Path, bytes: &[u8]) -> PathBuf {
    std::fs::write(path, bytes).unwrap();
    path.to_path_buf()
}

#[test]
fn checkpoints_detect_gguf_by_magic_or_extension() {
    let dir = scratch("detect");
    // The magic decides, whatever the name.
    let ckpt = Checkpoint::open(&write(&dir.join("model.bin"), &small_file().bytes())).unwrap();
    assert_eq!(ckpt.names(), ["output_norm.weight", "token_embd.weight"]);
    assert_eq!(ckpt.gguf().and_then(|g| g.get_str("general.architecture")), Some("llama"));
    let t = ckpt.get("token_embd.weight").unwrap().unwrap();
    assert_eq!(t, Tensor::f32(vec![2, 4], (0..8).map(|v| v as f32).collect()));
    assert_eq!(ckpt.all().unwrap().len(), 2);
    // A `.gguf` name with a wrong magic is reported as a GGUF error, not a safetensors one.
    let e = Checkpoint::open(&write(&dir.join("broken.gguf"), b"GGML\x03\0\0\0")).err().unwrap();
    assert!(matches!(e, WeightError::Gguf { error: GgufError::BadMagic { .. }, .. }), "{e:?}");
    assert!(e.to_string().contains("broken.gguf"), "{e}");
}

#[test]
fn missing_tensors_name_the_nearest_gguf_tensors() {
    let dir = scratch("missing");
    let ckpt = Checkpoint::open(&write(&dir.join("m.gguf"), &small_file().bytes())).unwrap();
    let params = [("token_embd.weigth".to_string(), vec![2, 4])];
    let map = kiln_compiler::spec::WeightMap::default();
    let dims = kiln_compiler::spec::PackDims { heads: 1, kv_heads: 1, head_dim: 4, d_ff: 4 };
    let e = kiln_runtime::weights::load_named(&map, &dims, &params, &ckpt).unwrap_err();
    assert!(matches!(&e, WeightError::MissingTensor { nearest, .. } if nearest[0] == "token_embd.weight"), "{e:?}");
    assert!(e.to_string().contains("nearest names in the file: token_embd.weight"), "{e}");
}

/// llama.cpp's converter stores each head's Q/K rows permuted for its interleaved RoPE:
/// `reshape(heads, 2, head_dim / 2, in).swapaxes(1, 2)`, so HF row `h*hd + j*hd/2 + i` moves to
/// `h*hd + 2i + j`.
fn llama_cpp_permute(t: &Tensor, heads: usize) -> Tensor {
    let (rows, cols) = (t.shape[0], t.shape[1]);
    let (hd, half) = (rows / heads, rows / heads / 2);
    let x = t.as_f32().unwrap();
    let mut out = vec![0.0; x.len()];
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..half {
                let (src, dst) = (h * hd + j * half + i, h * hd + 2 * i + j);
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&x[src * cols..(src + 1) * cols]);
            }
        }
    }
    Tensor::f32(t.shape.clone(), out)
}

/// The transformers checkpoint of the llama fixture rewritten as llama.cpp writes GGUF (its
/// tensor names, Q/K rows permuted, dimensions listed fastest first) loads through the
/// `gguf-llama` preset to the fixture's golden logits.
#[test]
fn a_llama_cpp_layout_checkpoint_reproduces_the_golden_logits() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let fixture = root.join("tests/fixtures/llama");
    let hf = kiln_runtime::read_tensors(&fixture.join("model.safetensors")).unwrap();
    let source = std::fs::read_to_string(root.join("models/llama.toml")).unwrap();
    let source = source.replace("preset = \"llama\"", "preset = \"gguf-llama\"");
    assert!(source.contains("gguf-llama"));
    let fe = kiln_compiler::front_end("llama-gguf.toml", &source).unwrap_or_else(|e| panic!("{}", e.render()));
    let (heads, kv_heads) = (fe.spec.spec.attention.heads as usize, fe.spec.kv_heads as usize);

    let rename = |name: &str| -> (String, Option<usize>) {
        let name = name.strip_prefix("model.").unwrap_or(name);
        let fixed = [
            ("embed_tokens.weight", "token_embd.weight"),
            ("norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ];
        if let Some((_, to)) = fixed.iter().find(|(from, _)| *from == name) {
            return (to.to_string(), None);
        }
        let rest = name.strip_prefix("layers.").unwrap();
        let (layer, part) = rest.split_once('.').unwrap();
        let (to, permute) = match part {
            "self_attn.q_proj.weight" => ("attn_q", Some(heads)),
            "self_attn.k_proj.weight" => ("attn_k", Some(kv_heads)),
            "self_attn.v_proj.weight" => ("attn_v", None),
            "self_attn.o_proj.weight" => ("attn_output", None),
            "mlp.gate_proj.weight" => ("ffn_gate", None),
            "mlp.up_proj.weight" => ("ffn_up", None),
            "mlp.down_proj.weight" => ("ffn_down", None),
            "input_layernorm.weight" => ("attn_norm", None),
            "post_attention_layernorm.weight" => ("ffn_norm", None),
            other => panic!("unexpected tensor {other}"),
        };
        (format!("blk.{layer}.{to}.weight"), permute)
    };
    let mut names: Vec<&String> = hf.keys().collect();
    names.sort();
    let mut b = Builder::new().kv_str("general.architecture", "llama");
    for name in names {
        let (to, permute) = rename(name);
        let t = match permute {
            Some(heads) => llama_cpp_permute(&hf[name], heads),
            None => hf[name].clone(),
        };
        let dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
        b = b.tensor(&to, &dims, GgmlType::F32, &f32_bytes(t.as_f32().unwrap()));
    }
    let path = write(&scratch("llama").join("llama.gguf"), &b.bytes());

    let params = kiln_runtime::load_params(&fe.spec, &fe.graph, &path).unwrap_or_else(|e| panic!("{e}"));
    let io = kiln_runtime::read_tensors(&fixture.join("io.safetensors")).unwrap();
    let outputs = kiln_compiler::interp::run(&fe.graph, &params, &io).unwrap();
    let logits = &outputs.iter().find(|(n, _)| n == "logits").unwrap().1;
    let err = logits.max_abs_diff(&io["logits"]);
    assert!(err <= 1e-4, "logits differ by {err}");
}

/// By hand, on a real checkpoint: every tensor of `KILN_GGUF` converts, and its first rows equal
/// bit for bit what gguf-py dequantized into `KILN_GGUF_REFERENCE` (`scripts/gguf-reference`);
/// every matrix kiln keeps as blocks repacks to a device layout that dequantizes to the same.
#[test]
#[ignore = "needs KILN_GGUF and KILN_GGUF_REFERENCE (see scripts/gguf-reference)"]
fn a_real_file_dequantizes_like_gguf_py() {
    let read = |var: &str| {
        let path = std::env::var(var).unwrap_or_else(|_| panic!("{var} is not set"));
        Gguf::parse(std::fs::read(path).unwrap()).unwrap()
    };
    let (model, reference) = (read("KILN_GGUF"), read("KILN_GGUF_REFERENCE"));
    assert_eq!(model.tensors().len(), reference.tensors().len());
    let mut repacked = 0;
    for info in model.tensors() {
        let got = tensor(&model, info.name());
        let want = tensor(&reference, info.name());
        let (got, want) = (got.as_f32().unwrap(), want.as_f32().unwrap());
        assert!(got.iter().all(|v| v.is_finite()), "{}: not finite", info.name());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got[..want.len()]), bits(want), "{} ({})", info.name(), info.ty());
        // A matrix of a type kept as blocks repacks into the device layout, whose dequantization
        // is the reader's.
        if let &[rows, k] = info.shape()
            && let Ok(q) = kiln_runtime::QuantWeight::from_blocks(
                info.ty(),
                rows,
                k,
                model.raw(info.name()).unwrap().unwrap().bytes,
            )
        {
            assert_eq!(bits(q.dequantize().as_f32().unwrap()), bits(got), "{} repacked as {}", info.name(), q.format);
            repacked += 1;
        }
    }
    eprintln!("{repacked} matrices repacked");
    assert!(repacked > 0, "no matrix of a type kept as blocks");
}
