//! Plain safetensors checkpoints laid out as safetensors' own writer lays them out (its `serialize`: tensors sorted
//! by dtype, widest first, then by name; no `__metadata__`; the header padded with spaces to a multiple of 8 bytes),
//! so that a reader can fill a state into such a file in place, tensor by tensor, and get the very bytes
//! `safetensors.numpy.save_file` writes for that state.

use std::borrow::Cow;
use std::collections::HashMap;

use safetensors::tensor::View;

use crate::core::dtype::{self, Dtype};
use crate::core::error::{Error, Result};

/// A checkpoint's layout: its header (the 8-byte length, then the JSON), the absolute byte range of each tensor in
/// the caller's order, and the file's size.
pub struct Layout {
    pub header: Vec<u8>,
    pub ranges: Vec<(u64, u64)>,
    pub size: u64,
}

/// A tensor known by its dtype and shape only: safetensors' writer lays it out without its bytes.
struct Shaped {
    dtype: Dtype,
    shape: Vec<usize>,
    len: usize,
}

impl View for &Shaped {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        self.len
    }
}

/// The layout of the checkpoint holding `tensors` (name, dtype, shape), as safetensors' `serialize` writes it.
pub fn layout(tensors: &[(String, Dtype, Vec<u64>)]) -> Result<Layout> {
    let mut shaped = Vec::with_capacity(tensors.len());
    for (name, dtype, shape) in tensors {
        let bytes = dtype::numel(shape)
            .and_then(|n| n.checked_mul(dtype::width_of(*dtype).ok()? as u64))
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| {
                Error::invalid(format!("tensor {name:?}: its {shape:?} {} bytes overflow", dtype::name_of(*dtype)))
            })?;
        let dims = shape.iter().map(|&d| usize::try_from(d)).collect::<std::result::Result<Vec<_>, _>>();
        let shape = dims.map_err(|_| Error::invalid(format!("tensor {name:?}: shape {shape:?} overflows")))?;
        shaped.push(Shaped { dtype: *dtype, shape, len: bytes });
    }
    let named: Vec<(&str, &Shaped)> = tensors.iter().map(|(name, ..)| name.as_str()).zip(&shaped).collect();
    let header = safetensors::tensor::serialize(named, None)
        .map_err(|e| Error::invalid(format!("cannot lay out a checkpoint of these tensors: {e}")))?;
    // Read the offsets back from the header the writer made rather than re-derive its order here.
    let json: HashMap<String, serde_json::Value> = serde_json::from_slice(&header[8..])
        .map_err(|e| Error::invalid(format!("safetensors wrote a header that does not parse: {e}")))?;
    let start = header.len() as u64;
    let mut ranges = Vec::with_capacity(tensors.len());
    let mut size = start;
    for ((name, ..), shaped) in tensors.iter().zip(&shaped) {
        let offsets = json
            .get(name)
            .and_then(|info| info.get("data_offsets"))
            .and_then(|o| Some((o.get(0)?.as_u64()?, o.get(1)?.as_u64()?)));
        let Some((begin, end)) = offsets.filter(|(b, e)| e.checked_sub(*b) == Some(shaped.len as u64)) else {
            return Err(Error::invalid(format!("safetensors laid out tensor {name:?} unexpectedly")));
        };
        ranges.push((start + begin, start + end));
        size = size.max(start + end);
    }
    Ok(Layout { header, ranges, size })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_serialize_with_the_bytes() {
        // Mixed dtypes and names out of order: the layout must be the one `serialize` gives with the data.
        let specs = [
            ("b", Dtype::BF16, vec![2u64, 3]),
            ("a", Dtype::F32, vec![3]),
            ("c", Dtype::U8, vec![0]),
            ("d", Dtype::BF16, vec![1]),
        ];
        let tensors: Vec<(String, Dtype, Vec<u64>)> =
            specs.iter().map(|(n, d, s)| (n.to_string(), *d, s.clone())).collect();
        let layout = layout(&tensors).unwrap();
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .enumerate()
            .map(|(i, (_, d, s))| vec![i as u8 + 1; (dtype::numel(s).unwrap() as usize) * dtype::width_of(*d).unwrap()])
            .collect();
        let views: Vec<(&str, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .zip(&data)
            .map(|((n, d, s), bytes)| {
                let shape: Vec<usize> = s.iter().map(|&x| x as usize).collect();
                (n.as_str(), safetensors::tensor::TensorView::new(*d, shape, bytes).unwrap())
            })
            .collect();
        let whole = safetensors::tensor::serialize(views, None).unwrap();
        assert_eq!(whole.len() as u64, layout.size);
        assert_eq!(&whole[..layout.header.len()], &layout.header[..]);
        let mut filled = layout.header.clone();
        filled.resize(layout.size as usize, 0);
        for ((start, end), bytes) in layout.ranges.iter().zip(&data) {
            filled[*start as usize..*end as usize].copy_from_slice(bytes);
        }
        assert_eq!(filled, whole);
        assert_eq!(layout.ranges[0], (layout.ranges[0].0, layout.ranges[0].0 + 12));
    }

    #[test]
    fn refuses_an_overflowing_shape() {
        let tensors = vec![("w".to_owned(), Dtype::F32, vec![u64::MAX, 2])];
        assert!(layout(&tensors).is_err());
    }

    #[test]
    fn the_size_is_the_end_of_the_last_tensor_in_the_file_not_in_the_callers_order() {
        // The caller's last tensor (F32) comes first in the file, where safetensors puts the widest dtype.
        let tensors = vec![("b".to_owned(), Dtype::U8, vec![3u64]), ("a".to_owned(), Dtype::F32, vec![4u64])];
        let layout = layout(&tensors).unwrap();
        let start = layout.header.len() as u64;
        assert_eq!(layout.ranges, vec![(start + 16, start + 19), (start, start + 16)]);
        assert_eq!(layout.size, start + 19);
        let (bytes_b, bytes_a) = (vec![1u8; 3], vec![2u8; 16]);
        let views = vec![
            ("b", safetensors::tensor::TensorView::new(Dtype::U8, vec![3], &bytes_b).unwrap()),
            ("a", safetensors::tensor::TensorView::new(Dtype::F32, vec![4], &bytes_a).unwrap()),
        ];
        assert_eq!(safetensors::tensor::serialize(views, None).unwrap().len() as u64, layout.size);
    }

    #[test]
    fn a_checkpoint_of_no_tensors_is_its_header() {
        let layout = layout(&[]).unwrap();
        assert!(layout.ranges.is_empty());
        assert_eq!(layout.size, layout.header.len() as u64);
        let empty: Vec<(&str, safetensors::tensor::TensorView<'_>)> = Vec::new();
        assert_eq!(safetensors::tensor::serialize(empty, None).unwrap(), layout.header);
    }
}
