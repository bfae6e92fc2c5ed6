//! Reading a plot back: a PNG's pixels, those of one colour, and where they lie — so that a
//! plot test checks each series was drawn, and where.

use std::path::Path;

/// Decoded RGB pixels of a PNG: (width, height, rgb bytes).
pub fn decode_png(path: &Path) -> (u32, u32, Vec<u8>) {
    let decoder = png::Decoder::new(std::fs::File::open(path).unwrap());
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

/// Pixels of exactly `color` as (x, y).
pub fn pixels_of(img: &(u32, u32, Vec<u8>), color: plotters::style::RGBColor) -> Vec<(u32, u32)> {
    let (w, _, buf) = img;
    buf.chunks(3)
        .enumerate()
        .filter(|(_, p)| (p[0], p[1], p[2]) == (color.0, color.1, color.2))
        .map(|(i, _)| (i as u32 % w, i as u32 / w))
        .collect()
}

/// Mean row of the pixels in columns x0..x1 (image rows grow downwards).
pub fn mean_y(px: &[(u32, u32)], x0: u32, x1: u32) -> f64 {
    let ys: Vec<f64> = px.iter().filter(|(x, _)| (x0..x1).contains(x)).map(|&(_, y)| y as f64).collect();
    assert!(!ys.is_empty(), "no pixels in columns {x0}..{x1}");
    ys.iter().sum::<f64>() / ys.len() as f64
}
