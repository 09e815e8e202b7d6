//! The `context` position codec (docs/format.md §5.2): the changed positions of a float tensor, coded per class of
//! the element in the base, its exponent relative to a reference exponent that the stream names.
//!
//! Both ends hold the base, so the classes cost nothing to send. Within a class, changes are far denser or sparser
//! than across the whole tensor: an optimizer's step has about the same size for every weight, while the spacing of
//! a float is relative to its magnitude, so small weights cross a rounding boundary far more often than large ones.
//! Each class lists the ranks (within the class, in row-major order) of its changed elements, or, where more than
//! half of its elements changed, of its unchanged ones, as Rice-coded gaps with a parameter per class.
//!
//! Decoding needs the exact base: the writer records its identity (docs/format.md §3.1) and every reader checks it
//! before decoding, so a wrong base is refused, never mis-decoded.

use super::bits::{BitReader, BitWriter};
use super::rice::{put_rice, read_gap, rice_k, MAX_RICE_K};
use super::varint;
use crate::core::dtype::Dtype;

/// Classes of base elements.
pub const CLASSES: usize = 16;
/// The class of the reference exponent: class `c` holds exponent fields `reference + c - CENTRE`, the first and
/// the last class everything below and above.
const CENTRE: i32 = 8;

/// Where a float dtype keeps its exponent field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exponent {
    /// Element width in bytes (2 or 4).
    pub width: usize,
    shift: u32,
    mask: u32,
}

impl Exponent {
    /// The exponent field of `dtype`, for the dtypes this codec takes (BF16, F16, F32); None for the others.
    pub fn of(dtype: Dtype) -> Option<Exponent> {
        match dtype {
            Dtype::BF16 => Some(Exponent { width: 2, shift: 7, mask: 0xff }),
            Dtype::F16 => Some(Exponent { width: 2, shift: 10, mask: 0x1f }),
            Dtype::F32 => Some(Exponent { width: 4, shift: 23, mask: 0xff }),
            _ => None,
        }
    }

    /// The exponent field of every element of `bytes`, in order, to `visit`.
    #[inline(always)]
    fn for_each(self, bytes: &[u8], mut visit: impl FnMut(usize)) {
        if self.width == 2 {
            for pair in bytes.chunks_exact(2) {
                visit(((u32::from(u16::from_le_bytes([pair[0], pair[1]])) >> self.shift) & self.mask) as usize);
            }
        } else {
            for word in bytes.chunks_exact(4) {
                visit(((u32::from_le_bytes([word[0], word[1], word[2], word[3]]) >> self.shift) & self.mask) as usize);
            }
        }
    }
}

/// The class of every exponent field value, for a reference exponent.
fn class_table(reference: u8) -> [u8; 256] {
    let mut table = [0u8; 256];
    for (field, class) in table.iter_mut().enumerate() {
        *class = (field as i32 - i32::from(reference) + CENTRE).clamp(0, CLASSES as i32 - 1) as u8;
    }
    table
}

/// A parsed stream header: the reference exponent and, per class, how many ranks are listed, whether they are
/// the unchanged elements' ranks, and the Rice parameter of their gaps.
#[derive(Debug)]
struct Header {
    reference: u8,
    listed: [u64; CLASSES],
    complement: [bool; CLASSES],
    k: [u32; CLASSES],
    /// Where the gaps' bits start.
    bits_from: usize,
}

fn read_header(bytes: &[u8], field: Exponent) -> Result<Header, String> {
    let reference = *bytes.first().ok_or("context stream is empty")?;
    if u32::from(reference) > field.mask {
        return Err(format!("context reference exponent {reference} is over the dtype's {}", field.mask));
    }
    let mut at = 1usize;
    let (mut listed, mut complement, mut k) = ([0u64; CLASSES], [false; CLASSES], [0u32; CLASSES]);
    for class in 0..CLASSES {
        let word = varint::read(bytes, &mut at).map_err(|_| format!("context stream: class {class}'s count is cut"))?;
        listed[class] = word >> 1;
        complement[class] = word & 1 == 1;
    }
    for class in 0..CLASSES {
        if listed[class] > 0 {
            let parameter = *bytes.get(at).ok_or("context stream: a Rice parameter is missing")?;
            at += 1;
            if u32::from(parameter) > MAX_RICE_K {
                return Err(format!("context stream: class {class}'s Rice parameter {parameter} is over {MAX_RICE_K}"));
            }
            k[class] = u32::from(parameter);
        }
    }
    Ok(Header { reference, listed, complement, k, bits_from: at })
}

/// Reads every class's listed ranks, each checked to be below `numel` and above the previous one.
fn read_ranks(bytes: &[u8], header: &Header, numel: u64) -> Result<Vec<Vec<u64>>, String> {
    let total: u64 = header.listed.iter().sum();
    if total > numel.saturating_mul(2) {
        return Err(format!("context stream lists {total} ranks for {numel} elements"));
    }
    let mut bits = BitReader::new(&bytes[header.bits_from..]);
    let mut ranks = Vec::with_capacity(CLASSES);
    for class in 0..CLASSES {
        let count = header.listed[class];
        if count > numel {
            return Err(format!("context stream: class {class} lists {count} ranks for {numel} elements"));
        }
        let mut list = Vec::with_capacity(count as usize);
        let mut next = 0u64;
        for _ in 0..count {
            let gap = read_gap(&mut bits, header.k[class]).map_err(|e| format!("class {class}'s rank {e}"))?;
            let rank = super::next_position(&mut next, gap, numel).map_err(|e| format!("class {class}'s {e}"))?;
            list.push(rank);
        }
        ranks.push(list);
    }
    if !bits.is_exhausted() {
        return Err("position stream has bytes after the last change".to_owned());
    }
    Ok(ranks)
}

/// Checks what can be checked of a `context` stream without the base: its header, that it holds exactly the
/// ranks it declares (each below `numel`), and, where no class lists unchanged elements, that they are `changed`.
pub fn check(bytes: &[u8], field: Exponent, changed: u64, numel: u64) -> Result<(), String> {
    let header = read_header(bytes, field)?;
    read_ranks(bytes, &header, numel)?;
    let listed_changes: u64 = (0..CLASSES).filter(|&c| !header.complement[c]).map(|c| header.listed[c]).sum();
    let exact = !header.complement.iter().any(|&c| c);
    if listed_changes > changed || (exact && listed_changes != changed) {
        return Err(format!("context stream lists {listed_changes} changes but the record says changed={changed}"));
    }
    Ok(())
}

/// The changed positions, ascending, of a `context` stream decoded against `base` (the tensor's bytes before the
/// change, which the caller has checked against the record's base identity). Fails where a rank lies past its
/// class, or the positions are not `changed` in number.
pub fn decode(bytes: &[u8], field: Exponent, base: &[u8], changed: u64) -> Result<Vec<u64>, String> {
    let numel = (base.len() / field.width) as u64;
    let header = read_header(bytes, field)?;
    let ranks = read_ranks(bytes, &header, numel)?;
    let table = class_table(header.reference);
    let mut seen = [0u64; CLASSES];
    let mut cursor = [0usize; CLASSES];
    let mut next = [u64::MAX; CLASSES];
    for class in 0..CLASSES {
        if let Some(&first) = ranks[class].first() {
            next[class] = first;
        }
    }
    let complement = header.complement;
    let mut positions = Vec::with_capacity(changed.min(numel) as usize);
    let mut index = 0u64;
    let mut overflow = false;
    field.for_each(base, |exponent| {
        let class = usize::from(table[exponent]);
        let rank = seen[class];
        seen[class] = rank + 1;
        let listed = rank == next[class];
        if listed {
            cursor[class] += 1;
            next[class] = ranks[class].get(cursor[class]).copied().unwrap_or(u64::MAX);
        }
        if listed != complement[class] {
            if positions.len() as u64 == changed {
                overflow = true;
            } else {
                positions.push(index);
            }
        }
        index += 1;
    });
    for class in 0..CLASSES {
        if cursor[class] != ranks[class].len() {
            return Err(format!(
                "context stream: class {class} lists rank {} but the base has {} elements in that class",
                ranks[class][cursor[class]], seen[class]
            ));
        }
    }
    if overflow || positions.len() as u64 != changed {
        return Err(format!(
            "context stream decodes to {} changes against the base but the record says changed={changed}",
            if overflow { "more".to_owned() } else { positions.len().to_string() }
        ));
    }
    Ok(positions)
}

/// The reference exponent the writer picks: the tensor's median exponent field (the lower median).
fn median_exponent(histogram: &[u64; 256]) -> u8 {
    let total: u64 = histogram.iter().sum();
    let mut below = 0u64;
    for (field, &count) in histogram.iter().enumerate() {
        below += count;
        if below * 2 >= total {
            return field as u8;
        }
    }
    0
}

/// The `context` stream of the changes at `positions` (ascending, each below the element count) against `base`.
pub fn encode(base: &[u8], field: Exponent, positions: &[u64]) -> Vec<u8> {
    let mut histogram = [0u64; 256];
    field.for_each(base, |exponent| histogram[exponent] += 1);
    let reference = median_exponent(&histogram);
    let table = class_table(reference);
    let mut population = [0u64; CLASSES];
    for (exponent, &count) in histogram.iter().enumerate() {
        population[usize::from(table[exponent])] += count;
    }
    // The rank of every changed element within its class.
    let mut ranks: Vec<Vec<u64>> = vec![Vec::new(); CLASSES];
    let mut seen = [0u64; CLASSES];
    let mut next = positions.iter().copied().peekable();
    let mut index = 0u64;
    field.for_each(base, |exponent| {
        let class = usize::from(table[exponent]);
        if next.peek() == Some(&index) {
            next.next();
            ranks[class].push(seen[class]);
        }
        seen[class] += 1;
        index += 1;
    });
    debug_assert!(next.next().is_none(), "positions within the tensor");
    // Where more than half of a class changed, list its unchanged elements instead.
    let mut complement = [false; CLASSES];
    for class in 0..CLASSES {
        if ranks[class].len() as u64 * 2 > population[class] {
            complement[class] = true;
            let changed = std::mem::take(&mut ranks[class]);
            let mut unchanged = Vec::with_capacity((population[class] - changed.len() as u64) as usize);
            let mut changed = changed.into_iter().peekable();
            for rank in 0..population[class] {
                if changed.peek() == Some(&rank) {
                    changed.next();
                } else {
                    unchanged.push(rank);
                }
            }
            ranks[class] = unchanged;
        }
    }
    let mut out = vec![reference];
    let mut k = [0u32; CLASSES];
    for class in 0..CLASSES {
        let list = &ranks[class];
        varint::write(&mut out, ((list.len() as u64) << 1) | u64::from(complement[class]));
        if let Some(&last) = list.last() {
            // The gaps sum to the last rank, less one per earlier rank.
            k[class] = rice_k(list.len() as u64, last + 1 - list.len() as u64);
        }
    }
    for class in 0..CLASSES {
        if !ranks[class].is_empty() {
            out.push(k[class] as u8);
        }
    }
    let mut bits = BitWriter::with_capacity(out.len() + positions.len());
    for class in 0..CLASSES {
        let mut previous_end = 0u64;
        for &rank in &ranks[class] {
            put_rice(&mut bits, rank - previous_end, k[class]);
            previous_end = rank + 1;
        }
    }
    out.extend_from_slice(&bits.finish());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bf16(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect()
    }

    /// A base of magnitudes spread over many exponents, with changes denser among the small ones.
    fn sample(n: usize, seed: u64) -> (Vec<u8>, Vec<u64>) {
        let mut state = seed | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let values: Vec<f32> =
            (0..n).map(|_| (next() % 4096) as f32 / 4096.0 * 2f32.powi(-((next() % 12) as i32))).collect();
        let base = bf16(&values);
        let positions = (0..n as u64)
            .filter(|&i| {
                let magnitude = values[i as usize].abs();
                next() % 1000
                    < if magnitude < 1e-3 {
                        700
                    } else if magnitude < 0.05 {
                        40
                    } else {
                        3
                    }
            })
            .collect();
        (base, positions)
    }

    #[test]
    fn roundtrips_and_beats_rice_on_magnitude_dependent_changes() {
        let field = Exponent::of(Dtype::BF16).unwrap();
        for (n, seed) in [(0usize, 1u64), (1, 2), (7, 3), (1000, 4), (100_000, 5)] {
            let (base, positions) = sample(n, seed);
            let stream = encode(&base, field, &positions);
            check(&stream, field, positions.len() as u64, n as u64).unwrap();
            assert_eq!(decode(&stream, field, &base, positions.len() as u64).unwrap(), positions, "n={n}");
            if n == 100_000 {
                let gaps = positions.iter().scan(0u64, |end, &p| {
                    let gap = p - *end;
                    *end = p + 1;
                    Some(gap)
                });
                let rice = super::super::rice::write_rice(
                    gaps,
                    rice_k(positions.len() as u64, positions.last().unwrap() + 1 - positions.len() as u64),
                );
                assert!(stream.len() * 10 < rice.len() * 8, "context {} bytes, rice {}", stream.len(), rice.len());
            }
        }
    }

    #[test]
    fn f16_and_f32_roundtrip() {
        for dtype in [Dtype::F16, Dtype::F32] {
            let field = Exponent::of(dtype).unwrap();
            let base: Vec<u8> = (0..4000u32)
                .flat_map(|i| {
                    let bits = i.wrapping_mul(2654435761);
                    if field.width == 2 {
                        (bits as u16).to_le_bytes().to_vec()
                    } else {
                        bits.to_le_bytes().to_vec()
                    }
                })
                .collect();
            let positions: Vec<u64> = (0..4000u64).filter(|i| i % 3 == 0 || i % 7 == 1).collect();
            let stream = encode(&base, field, &positions);
            assert_eq!(decode(&stream, field, &base, positions.len() as u64).unwrap(), positions, "{dtype:?}");
        }
    }

    #[test]
    fn a_wrong_base_or_count_is_refused_or_differs() {
        let field = Exponent::of(Dtype::BF16).unwrap();
        let (base, positions) = sample(5000, 9);
        let stream = encode(&base, field, &positions);
        let count = positions.len() as u64;
        assert!(decode(&stream, field, &base, count + 1).is_err());
        assert!(decode(&stream, field, &base, count - 1).is_err());
        assert!(decode(&stream, field, &base[..base.len() / 2], count).is_err());
        assert!(check(&stream, field, count, 10).is_err(), "ranks past a 10-element tensor");
        let mut trailing = stream.clone();
        trailing.push(0);
        assert!(check(&trailing, field, count, 5000).is_err());
        assert!(check(&stream[..stream.len() - 1], field, count, 5000).is_err());
        assert!(check(&[], field, 0, 0).is_err());
        assert!(check(&[0xff], Exponent::of(Dtype::F16).unwrap(), 0, 0).is_err(), "reference over 31");
    }
}
