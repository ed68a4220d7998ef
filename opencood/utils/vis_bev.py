"""Bird's-eye-view pictures with OpenCV: points per agent, GT and predicted boxes, metre grid.

Image axes: column grows with x, row grows with y. OPV2V poses are CARLA's left-handed frame
(y points to the right of x when seen from above), so this is the true, unmirrored top view.
Colours are BGR, as OpenCV expects.
"""
from __future__ import annotations

import cv2
import numpy as np

from opencood.ops.transforms import boxes_to_bev_corners

# Distinct, bright on black: one per agent, ego first (BGR: sky blue, amber, magenta, white,
# orange, royal blue, pink, teal). No green among them: green is the GT's colour, and a cloud of
# green points around green boxes hides them (each hue is at least 45 degrees from GT_COLOR's).
AGENT_COLORS = [(255, 200, 0), (0, 200, 255), (255, 0, 255), (255, 255, 255), (0, 120, 255),
                (255, 110, 70), (170, 110, 255), (180, 180, 0)]
GT_COLOR = (0, 255, 0)
OCCLUDED_GT_COLOR = (255, 140, 200)  # lavender: GT the ego's own LiDAR does not see
PRED_COLOR = (0, 0, 255)
GRID_COLOR = (45, 45, 45)
TEXT_COLOR = (230, 230, 230)


def bev_range_2d(bev_range) -> tuple:
    """(xmin, ymin, xmax, ymax) from a 4-value range or a 6-value [x, y, z] min/max range."""
    values = [float(v) for v in bev_range]
    if len(values) == 6:
        values = [values[0], values[1], values[3], values[4]]
    if len(values) != 4 or values[0] >= values[2] or values[1] >= values[3]:
        raise ValueError(f"bev range must be xmin ymin [zmin] xmax ymax [zmax] with min < max, "
                         f"got {list(bev_range)}")
    return tuple(values)


class BevCanvas:
    """A black BEV image covering ``bev_range`` at ``pixels_per_meter``."""

    def __init__(self, bev_range, pixels_per_meter: float = 10.0):
        self.xmin, self.ymin, self.xmax, self.ymax = bev_range_2d(bev_range)
        self.ppm = float(pixels_per_meter)
        width = int(round((self.xmax - self.xmin) * self.ppm))
        height = int(round((self.ymax - self.ymin) * self.ppm))
        self.image = np.zeros((height, width, 3), dtype=np.uint8)

    @property
    def size(self) -> tuple:
        """(width, height) in pixels."""
        return self.image.shape[1], self.image.shape[0]

    def to_pixels(self, xy) -> np.ndarray:
        """Metric (N, 2) x/y -> integer pixel (N, 2) column/row (may fall outside the image)."""
        xy = np.asarray(xy, dtype=np.float64).reshape(-1, 2)
        cols = (xy[:, 0] - self.xmin) * self.ppm
        rows = (xy[:, 1] - self.ymin) * self.ppm
        return np.stack([cols, rows], axis=1).round().astype(np.int32)

    def draw_grid(self, step: float = 10.0):
        """Grid lines every ``step`` metres (brighter through the origin) and a scale bar."""
        width, height = self.size
        for x in np.arange(np.ceil(self.xmin / step) * step, self.xmax, step):
            col = self.to_pixels([[x, 0.0]])[0, 0]
            color = (90, 90, 90) if abs(x) < 1e-9 else GRID_COLOR
            cv2.line(self.image, (int(col), 0), (int(col), height - 1), color, 1)
        for y in np.arange(np.ceil(self.ymin / step) * step, self.ymax, step):
            row = self.to_pixels([[0.0, y]])[0, 1]
            color = (90, 90, 90) if abs(y) < 1e-9 else GRID_COLOR
            cv2.line(self.image, (0, int(row)), (width - 1, int(row)), color, 1)
        bar = int(round(step * self.ppm))
        y0 = height - 15
        cv2.line(self.image, (10, y0), (10 + bar, y0), TEXT_COLOR, 2)
        cv2.putText(self.image, f"{step:g} m", (10, y0 - 6), cv2.FONT_HERSHEY_SIMPLEX, 0.45,
                    TEXT_COLOR, 1, cv2.LINE_AA)

    def draw_points(self, points, color):
        """Points (N, 2+) (x, y first), one pixel each."""
        if len(points) == 0:
            return
        pixels = self.to_pixels(np.asarray(points)[:, :2])
        width, height = self.size
        inside = (pixels[:, 0] >= 0) & (pixels[:, 0] < width) & \
                 (pixels[:, 1] >= 0) & (pixels[:, 1] < height)
        self.image[pixels[inside, 1], pixels[inside, 0]] = color

    def draw_boxes(self, boxes, color, order: str = "hwl", thickness: int = 2):
        """Boxes (M, 7) as rotated rectangles with a tick from the centre to the front edge."""
        boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 7)
        if len(boxes) == 0:
            return
        corners = boxes_to_bev_corners(boxes, order)                       # (M, 4, 2)
        for box_corners in corners:
            pixels = self.to_pixels(box_corners)
            # LINE_8, not anti-aliased: box edges keep their exact colour (easy to read, test).
            cv2.polylines(self.image, [pixels.reshape(-1, 1, 2)], True, color, thickness,
                          cv2.LINE_8)
            center = self.to_pixels(box_corners.mean(axis=0))[0]
            front = self.to_pixels(box_corners[:2].mean(axis=0))[0]   # corners 0,1: front edge
            cv2.line(self.image, tuple(int(v) for v in center), tuple(int(v) for v in front),
                     color, thickness, cv2.LINE_8)

    def draw_marker(self, xy, color, label: str | None = None):
        """A ringed dot at metric ``xy`` with an optional text label."""
        col, row = (int(v) for v in self.to_pixels(xy)[0])
        cv2.circle(self.image, (col, row), 6, color, -1, cv2.LINE_AA)
        cv2.circle(self.image, (col, row), 9, TEXT_COLOR, 1, cv2.LINE_AA)
        if label:
            cv2.putText(self.image, label, (col + 11, row - 8), cv2.FONT_HERSHEY_SIMPLEX, 0.45,
                        color, 1, cv2.LINE_AA)

    def draw_title(self, text: str):
        """``text`` (the frame id) in the top-right corner on a dark panel."""
        (text_w, text_h), _ = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, 0.45, 1)
        right = self.size[0] - 4
        cv2.rectangle(self.image, (right - text_w - 12, 4), (right, 12 + text_h), (20, 20, 20),
                      -1)
        cv2.putText(self.image, text, (right - text_w - 6, 8 + text_h), cv2.FONT_HERSHEY_SIMPLEX,
                    0.45, TEXT_COLOR, 1, cv2.LINE_AA)

    def draw_legend(self, items):
        """``items``: [(label, color)] listed in the top-left corner on a dark panel."""
        if not items:
            return
        line = 18
        panel_w = 16 + 9 * max(len(label) for label, _ in items) + 24
        overlay = self.image.copy()
        cv2.rectangle(overlay, (4, 4), (4 + panel_w, 10 + line * len(items)), (20, 20, 20), -1)
        self.image[:] = cv2.addWeighted(overlay, 0.75, self.image, 0.25, 0)
        for k, (label, color) in enumerate(items):
            y = 10 + line * k
            cv2.rectangle(self.image, (10, y + 3), (22, y + 13), color, -1)
            cv2.putText(self.image, label, (28, y + 13), cv2.FONT_HERSHEY_SIMPLEX, 0.45,
                        TEXT_COLOR, 1, cv2.LINE_AA)


def render_bev(points_by_agent: dict, bev_range, gt_boxes=None, pred_boxes=None,
               agent_positions: dict | None = None, pixels_per_meter: float = 10.0,
               order: str = "hwl", grid_step: float = 10.0,
               occluded_gt_boxes=None, title: str | None = None) -> np.ndarray:
    """One BEV picture (H, W, 3) uint8 BGR.

    points_by_agent: {name: points (N, 2+) in the drawing frame}, coloured by insertion order.
    gt_boxes / pred_boxes: (M, 7) boxes in that frame (``order``), drawn green / red.
    occluded_gt_boxes: (M, 7) GT boxes the ego does not see itself, drawn lavender.
    agent_positions: {name: (x, y)} marked with a dot in the agent's colour.
    title: written in the top-right corner (the frame: scenario and timestamp).
    """
    canvas = BevCanvas(bev_range, pixels_per_meter)
    canvas.draw_grid(grid_step)
    legend = []
    for k, (name, points) in enumerate(points_by_agent.items()):
        color = AGENT_COLORS[k % len(AGENT_COLORS)]
        canvas.draw_points(points, color)
        legend.append((str(name), color))
    if gt_boxes is not None:
        canvas.draw_boxes(gt_boxes, GT_COLOR, order)
        legend.append(("ground truth", GT_COLOR))
    if occluded_gt_boxes is not None and len(occluded_gt_boxes):
        canvas.draw_boxes(occluded_gt_boxes, OCCLUDED_GT_COLOR, order)
        legend.append(("GT occluded for ego", OCCLUDED_GT_COLOR))
    if pred_boxes is not None:
        canvas.draw_boxes(pred_boxes, PRED_COLOR, order)
        legend.append(("prediction", PRED_COLOR))
    colors = {name: color for name, color in legend}
    for name, xy in (agent_positions or {}).items():
        canvas.draw_marker(xy, colors.get(str(name), TEXT_COLOR), str(name))
    canvas.draw_legend(legend)
    if title:
        canvas.draw_title(title)
    return canvas.image


def save_image(path, image: np.ndarray):
    """Write ``image`` (PNG/JPG by extension); raise OSError naming the path on failure."""
    if not cv2.imwrite(str(path), image):
        raise OSError(f"could not write image {path!s} (missing folder or unknown extension?)")
