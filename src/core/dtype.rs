//! Element dtypes the core handles: safetensors' own `Dtype`, restricted to whole-byte widths.

pub use safetensors::Dtype;

use crate::core::error::{Error, Result};

/// Byte width of one element, or an error for dtypes we cannot bit-compare per element.
pub fn width_of(dtype: Dtype) -> Result<usize> {
    match dtype.bitsize() {
        8 => Ok(1),
        16 => Ok(2),
        32 => Ok(4),
        64 => Ok(8),
        bits => Err(Error::invalid(format!(
            "dtype {} has {bits}-bit elements; only 8-, 16-, 32- and 64-bit dtypes are supported",
            name_of(dtype)
        ))),
    }
}

/// The safetensors spelling of a dtype ("BF16", "F8_E4M3", ...).
pub fn name_of(dtype: Dtype) -> String {
    serde_json::to_value(dtype)
        .ok()
        .and_then(|value| value.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{dtype:?}"))
}

/// Parses a safetensors dtype name.
pub fn parse(name: &str) -> Result<Dtype> {
    let dtype: Dtype = serde_json::from_value(serde_json::Value::String(name.to_owned()))
        .map_err(|_| Error::invalid(format!("unknown dtype {name:?}")))?;
    width_of(dtype)?;
    Ok(dtype)
}

/// Number of elements of a shape, or None on overflow.
pub fn numel(shape: &[u64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &dim| acc.checked_mul(dim))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_roundtrip() {
        for name in ["BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "I8", "U8", "I32", "F64", "BOOL"] {
            assert_eq!(name_of(parse(name).unwrap()), name);
        }
        assert!(parse("F4").is_err());
        assert!(parse("nope").is_err());
    }

    #[test]
    fn numel_overflow() {
        assert_eq!(numel(&[]), Some(1));
        assert_eq!(numel(&[3, 0, 5]), Some(0));
        assert_eq!(numel(&[u64::MAX, 2]), None);
    }
}
